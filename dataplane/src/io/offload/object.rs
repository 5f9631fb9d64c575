//! Reads the BPF object clang built (`offload.c`): one program section's instructions with its
//! map references pointed at the maps user space created, and the license. An ELF64
//! little-endian relocatable file, read only as far as that needs.

use std::collections::HashMap;

/// `ld_imm64`: the instruction a map reference is.
const LD_IMM64: u8 = 0x18;
/// `src_reg` of an `ld_imm64` whose immediate is a map file descriptor.
const PSEUDO_MAP_FD: u8 = 1;
const SHT_SYMTAB: u32 = 2;
const SHT_REL: u32 = 9;

/// A malformed object or a reference to an unknown map.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct BadObject(pub(super) String);

impl std::fmt::Display for BadObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BPF object: {}", self.0)
    }
}

struct Section<'a> {
    name: &'a str,
    kind: u32,
    link: u32,
    info: u32,
    bytes: &'a [u8],
}

fn range(offset: usize, len: usize) -> Result<std::ops::Range<usize>, BadObject> {
    let end = offset
        .checked_add(len)
        .ok_or_else(|| BadObject(format!("offset {offset} out of range")))?;
    Ok(offset..end)
}

fn field(bytes: &[u8], offset: usize, len: usize) -> Result<u64, BadObject> {
    let slice = bytes
        .get(range(offset, len)?)
        .ok_or_else(|| BadObject(format!("truncated at byte {offset}")))?;
    let mut word = [0u8; 8];
    word[..len].copy_from_slice(slice);
    Ok(u64::from_le_bytes(word))
}

fn sections(elf: &[u8]) -> Result<Vec<Section<'_>>, BadObject> {
    if elf.get(..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1]) {
        return Err(BadObject("not a 64-bit little-endian ELF file".into()));
    }
    let shoff = field(elf, 0x28, 8)? as usize;
    let shentsize = field(elf, 0x3a, 2)? as usize;
    let shnum = field(elf, 0x3c, 2)? as usize;
    let shstrndx = field(elf, 0x3e, 2)? as usize;
    let mut raw = Vec::with_capacity(shnum);
    for i in 0..shnum {
        let h = i
            .checked_mul(shentsize)
            .and_then(|o| o.checked_add(shoff))
            .filter(|h| h.checked_add(64).is_some_and(|end| end <= elf.len()))
            .ok_or_else(|| BadObject("section headers out of the file".into()))?;
        let offset = field(elf, h + 24, 8)? as usize;
        let size = field(elf, h + 32, 8)? as usize;
        let kind = field(elf, h + 4, 4)? as u32;
        // SHT_NOBITS has no bytes in the file.
        let bytes = if kind == 8 {
            &[][..]
        } else {
            elf.get(range(offset, size)?)
                .ok_or_else(|| BadObject(format!("section {i} out of the file")))?
        };
        raw.push((
            field(elf, h, 4)? as usize,
            kind,
            field(elf, h + 40, 4)? as u32,
            field(elf, h + 44, 4)? as u32,
            bytes,
        ));
    }
    let names = raw
        .get(shstrndx)
        .map(|s| s.4)
        .ok_or_else(|| BadObject("no section names".into()))?;
    raw.into_iter()
        .map(|(name, kind, link, info, bytes)| {
            Ok(Section {
                name: string(names, name)?,
                kind,
                link,
                info,
                bytes,
            })
        })
        .collect()
}

fn string(table: &[u8], offset: usize) -> Result<&str, BadObject> {
    let rest = table
        .get(offset..)
        .ok_or_else(|| BadObject(format!("string {offset} out of its table")))?;
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    std::str::from_utf8(&rest[..end]).map_err(|_| BadObject("a name is not UTF-8".into()))
}

/// A program ready to load.
#[derive(Debug)]
pub(super) struct Program {
    pub(super) insns: Vec<u8>,
    pub(super) license: String,
}

/// The instructions of section `section` of `elf`, every map reference pointing at the file
/// descriptor `maps` gives for its symbol name.
pub(super) fn program(
    elf: &[u8],
    section: &str,
    maps: &HashMap<&str, i32>,
) -> Result<Program, BadObject> {
    let sections = sections(elf)?;
    let index = sections
        .iter()
        .position(|s| s.name == section)
        .ok_or_else(|| BadObject(format!("no section {section:?}")))?;
    let mut insns = sections[index].bytes.to_vec();
    let license = sections
        .iter()
        .find(|s| s.name == "license")
        .map(|s| string(s.bytes, 0).map(str::to_owned))
        .transpose()?
        .unwrap_or_default();
    for rel in sections
        .iter()
        .filter(|s| s.kind == SHT_REL && s.info as usize == index)
    {
        let symtab = sections
            .get(rel.link as usize)
            .filter(|s| s.kind == SHT_SYMTAB)
            .ok_or_else(|| BadObject("relocations without a symbol table".into()))?;
        let strtab = sections
            .get(symtab.link as usize)
            .ok_or_else(|| BadObject("symbols without names".into()))?
            .bytes;
        for entry in rel.bytes.chunks_exact(16) {
            let offset = field(entry, 0, 8)? as usize;
            let symbol = (field(entry, 8, 8)? >> 32) as usize;
            let at = symbol
                .checked_mul(24)
                .ok_or_else(|| BadObject(format!("symbol {symbol} out of range")))?;
            let name = string(strtab, field(symtab.bytes, at, 4)? as usize)?;
            let fd = maps.get(name).ok_or_else(|| {
                BadObject(format!(
                    "the program uses map {name:?}, which was not created"
                ))
            })?;
            let insn = insns
                .get_mut(range(offset, 16)?)
                .filter(|i| i[0] == LD_IMM64)
                .ok_or_else(|| BadObject(format!("relocation at {offset} is not a 64-bit load")))?;
            // dst_reg stays; src_reg (the high nibble) says "map fd"; the immediate is the fd.
            insn[1] = (insn[1] & 0x0f) | (PSEUDO_MAP_FD << 4);
            insn[4..8].copy_from_slice(&fd.to_le_bytes());
            insn[12..16].copy_from_slice(&[0; 4]);
        }
    }
    Ok(Program { insns, license })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_a_bad_object_not_a_panic() {
        let maps = HashMap::new();
        assert!(program(b"", "tc", &maps).is_err());
        assert!(program(b"\x7fELF\x02\x01rest", "tc", &maps).is_err());
        let mut elf = vec![0x7f, b'E', b'L', b'F', 2, 1];
        elf.resize(64, 0xff);
        assert!(program(&elf, "tc", &maps).is_err());
    }
}
