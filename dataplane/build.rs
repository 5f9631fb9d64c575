//! Builds the offload's BPF program (`src/io/offload/offload.c`) with clang, when clang and
//! libbpf's headers are installed (Debian: `clang`, `libbpf-dev`; the README's test command
//! installs them). Without them the dataplane builds all the same, and `--offload` says the
//! build has no program and how to get one.
//!
//! It also reads the maps' layout (`src/io/offload/offload.h`, the one definition) and writes
//! what each side checks it against: `layout.rs` (the Rust `#[repr(C)]` types and constants
//! `maps.rs` includes, with `size_of`/`offset_of!` asserts) and `layout_check.c` (clang's
//! `_Static_assert`s of the same sizes and offsets, checked with the program's build).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The production program, and the bench-only limit programs (built apart, so that the object
/// stunnerd loads holds only what it runs).
const SOURCES: [(&str, &str); 2] = [
    ("src/io/offload/offload.c", "offload.o"),
    ("src/io/offload/limit.c", "limit.o"),
];
/// The maps' layout, shared by `offload.c` and `maps.rs`.
const HEADER: &str = "src/io/offload/offload.h";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(uturn_bpf)");
    for (source, _) in SOURCES {
        println!("cargo::rerun-if-changed={source}");
    }
    println!("cargo::rerun-if-changed={HEADER}");
    println!("cargo::rerun-if-env-changed=UTURN_CLANG");
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let text = std::fs::read_to_string(HEADER).expect("src/io/offload/offload.h is readable");
    let layout = match layout::parse(&text) {
        Ok(layout) => layout,
        Err(e) => panic!("{HEADER}:{e}"),
    };
    std::fs::write(out_dir.join("layout.rs"), layout::rust(&layout)).expect("OUT_DIR writable");
    let check = out_dir.join("layout_check.c");
    std::fs::write(&check, layout::c_asserts(&layout)).expect("OUT_DIR writable");
    if let Err(why) = build_programs(&out_dir, &check) {
        println!("cargo::warning=built without the BPF offload program: {why}");
    }
}

/// Compiles the layout check and the programs with the first clang installed: `Ok` when they
/// all built (`cfg(uturn_bpf)` set), else why not.
fn build_programs(out_dir: &Path, check: &Path) -> Result<(), String> {
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    // Where Debian keeps <asm/types.h>, which <linux/bpf.h> includes.
    let multiarch = format!("/usr/include/{arch}-linux-gnu");
    let candidates: Vec<String> = match env::var("UTURN_CLANG") {
        Ok(clang) => vec![clang],
        Err(_) => std::iter::once("clang".to_owned())
            .chain((14..=21).rev().map(|v| format!("clang-{v}")))
            .collect(),
    };
    let check = check.to_string_lossy().into_owned();
    let mut jobs = vec![(check, out_dir.join("layout_check.o"))];
    jobs.extend(SOURCES.map(|(source, object)| (source.to_owned(), out_dir.join(object))));
    for clang in candidates {
        let mut installed = true;
        for (source, object) in &jobs {
            // -g: the object carries BTF, which describes the `.maps` definitions to the
            // loader.
            let built = Command::new(&clang)
                .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
                .args(["-I", &multiarch, "-I", "src/io/offload", "-c", source, "-o"])
                .arg(object)
                .output();
            match built {
                Ok(output) if output.status.success() => {}
                Ok(output) => {
                    let stderr = String::from_utf8_lossy(&output.stderr);
                    let first = stderr.lines().next().unwrap_or("");
                    return Err(format!("{clang} failed on {source}: {first}"));
                }
                Err(_) => {
                    installed = false;
                    break;
                }
            }
        }
        if installed {
            println!("cargo::rustc-cfg=uturn_bpf");
            // The one search for a clang: tests that build BPF programs of their own take this
            // one (`uturn_dataplane::io::offload::BPF_CLANG`).
            println!("cargo::rustc-env=UTURN_BPF_CLANG={clang}");
            return Ok(());
        }
        // This clang is not installed: try the next name.
    }
    Err("no clang found (install clang and libbpf-dev)".to_owned())
}

/// The part of C `offload.h` may use, read and written out for both sides.
mod layout {
    use std::fmt::Write as _;

    /// A `#define NAME NUMBER`.
    pub(crate) struct Define {
        name: String,
        value: u64,
        doc: Vec<String>,
    }

    /// A field: its C type's size in bytes (1, 2, 4, 8), the array length if any.
    pub(crate) struct Field {
        name: String,
        size: usize,
        len: Option<usize>,
        offset: usize,
        doc: Option<String>,
    }

    /// A `struct NAME { ... };` laid out at natural alignment.
    pub(crate) struct Struct {
        name: String,
        fields: Vec<Field>,
        size: usize,
        doc: Vec<String>,
    }

    /// What the header defines, in its order.
    pub(crate) struct Layout {
        defines: Vec<Define>,
        structs: Vec<Struct>,
    }

    /// The lines that are only the header's frame (include guard, `<linux/types.h>`).
    const FRAME: [&str; 4] = [
        "#ifndef UTURN_OFFLOAD_H",
        "#define UTURN_OFFLOAD_H",
        "#include <linux/types.h>",
        "#endif",
    ];

    /// Reads `text`; an error is `LINE: what is wrong`.
    pub(crate) fn parse(text: &str) -> Result<Layout, String> {
        let mut layout = Layout {
            defines: Vec::new(),
            structs: Vec::new(),
        };
        let mut doc: Vec<String> = Vec::new();
        let mut open: Option<Struct> = None;
        for (i, raw) in text.lines().enumerate() {
            let at = i + 1;
            let line = raw.trim();
            let fail = |why: &str| Err(format!("{at}: {why}: `{line}`"));
            if let Some(s) = open.as_mut() {
                if line == "};" {
                    let s = open.take().expect("a struct is open");
                    layout
                        .structs
                        .push(close(s).map_err(|e| format!("{at}: {e}"))?);
                } else if !line.starts_with("//") {
                    let field = parse_field(line).ok_or_else(|| {
                        format!(
                            "{at}: not a field of __u8, __u16, __u32 or __u64 (or an array of \
                             them): `{line}`"
                        )
                    })?;
                    s.fields.push(field);
                }
                continue;
            }
            if line.is_empty() {
                doc.clear();
            } else if let Some(comment) = line.strip_prefix("//") {
                doc.push(comment.trim().to_owned());
            } else if FRAME.contains(&line) {
                doc.clear();
            } else if let Some(rest) = line.strip_prefix("#define ") {
                let mut words = rest.split_whitespace();
                let (Some(name), Some(value), None) = (words.next(), words.next(), words.next())
                else {
                    return fail("not `#define NAME NUMBER`");
                };
                let Ok(value) = value.parse::<u64>() else {
                    return fail("not a decimal number");
                };
                if !is_name(name) {
                    return fail("not a C name");
                }
                let doc = std::mem::take(&mut doc);
                layout.defines.push(Define {
                    name: name.to_owned(),
                    value,
                    doc,
                });
            } else if let Some(name) = line
                .strip_prefix("struct ")
                .and_then(|r| r.strip_suffix(" {"))
                .filter(|n| is_name(n))
            {
                open = Some(Struct {
                    name: name.to_owned(),
                    fields: Vec::new(),
                    size: 0,
                    doc: std::mem::take(&mut doc),
                });
            } else {
                return fail(
                    "build.rs reads only `struct NAME {` of __u8..__u64 fields, \
                     `#define NAME NUMBER` and comments",
                );
            }
        }
        if let Some(s) = open {
            return Err(format!("end: struct {} is not closed with `}};`", s.name));
        }
        Ok(layout)
    }

    fn is_name(s: &str) -> bool {
        !s.is_empty()
            && !s.starts_with(|c: char| c.is_ascii_digit())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    }

    /// `__u32 name; // doc` or `__u8 name[12]; // doc`.
    fn parse_field(line: &str) -> Option<Field> {
        let (code, doc) = match line.split_once("//") {
            Some((code, doc)) => (code.trim(), Some(doc.trim().to_owned())),
            None => (line, None),
        };
        let (ty, rest) = code.strip_suffix(';')?.split_once(' ')?;
        let size = match ty {
            "__u8" => 1,
            "__u16" => 2,
            "__u32" => 4,
            "__u64" => 8,
            _ => return None,
        };
        let rest = rest.trim();
        let (name, len) = match rest.split_once('[') {
            Some((name, len)) => (name, Some(len.strip_suffix(']')?.parse().ok()?)),
            None => (rest, None),
        };
        is_name(name).then(|| Field {
            name: name.to_owned(),
            size,
            len,
            offset: 0,
            doc,
        })
    }

    /// Lays `s` out; a field off its natural alignment or a tail that would pad is an error
    /// (a hash key is compared byte for byte, padding included).
    fn close(mut s: Struct) -> Result<Struct, String> {
        let mut offset = 0;
        let mut align = 1;
        for f in &mut s.fields {
            if offset % f.size != 0 {
                return Err(format!(
                    "struct {}: field {} at byte {offset} is not {}-byte aligned; write a pad \
                     field before it",
                    s.name, f.name, f.size
                ));
            }
            f.offset = offset;
            offset += f.size * f.len.unwrap_or(1);
            align = align.max(f.size);
        }
        if s.fields.is_empty() || offset % align != 0 {
            return Err(format!(
                "struct {}: {offset} bytes is not a multiple of its {align}-byte alignment; \
                 write a pad field at its end",
                s.name
            ));
        }
        s.size = offset;
        Ok(s)
    }

    fn camel(name: &str) -> String {
        name.split('_')
            .map(|w| {
                let mut c = w.chars();
                c.next()
                    .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                    .unwrap_or_default()
            })
            .collect()
    }

    fn rust_type(f: &Field) -> String {
        let word = format!("u{}", f.size * 8);
        match f.len {
            Some(n) => format!("[{word}; {n}]"),
            None => word,
        }
    }

    fn doc_lines(out: &mut String, indent: &str, doc: &[String]) {
        for line in doc {
            let _ = writeln!(out, "{indent}/// {line}");
        }
    }

    /// The Rust types and constants, with their asserts.
    pub(crate) fn rust(layout: &Layout) -> String {
        let mut out =
            String::from("// Generated by dataplane/build.rs from src/io/offload/offload.h.\n\n");
        for d in &layout.defines {
            doc_lines(&mut out, "", &d.doc);
            let ty = if d.value <= u64::from(u32::MAX) {
                "u32"
            } else {
                "u64"
            };
            let _ = writeln!(out, "pub(crate) const {}: {ty} = {};\n", d.name, d.value);
        }
        for s in &layout.structs {
            rust_struct(&mut out, s);
        }
        out
    }

    fn rust_struct(out: &mut String, s: &Struct) {
        let name = camel(&s.name);
        doc_lines(out, "", &s.doc);
        let _ = writeln!(out, "///\n/// `struct {}` ({} bytes).", s.name, s.size);
        out.push_str("#[repr(C)]\n#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]\n");
        let _ = writeln!(out, "pub(crate) struct {name} {{");
        for f in &s.fields {
            let doc = f.doc.clone().unwrap_or_else(|| format!("`{}`.", f.name));
            let _ = writeln!(out, "    /// {doc}");
            let _ = writeln!(out, "    pub(crate) {}: {},", f.name, rust_type(f));
        }
        out.push_str("}\n\n");
        let _ = writeln!(out, "impl {name} {{");
        rust_to_bytes(out, s);
        out.push('\n');
        rust_from_bytes(out, s, &name);
        out.push_str("}\n\n");
        let _ = writeln!(
            out,
            "const _: () = assert!(std::mem::size_of::<{name}>() == {});",
            s.size
        );
        for f in &s.fields {
            let _ = writeln!(
                out,
                "const _: () = assert!(std::mem::offset_of!({name}, {}) == {});",
                f.name, f.offset
            );
        }
        out.push('\n');
    }

    /// `to_bytes`: each field's bytes at its offset.
    fn rust_to_bytes(out: &mut String, s: &Struct) {
        let _ = writeln!(out, "    /// Its bytes, as the kernel map holds them.");
        let _ = writeln!(
            out,
            "    pub(crate) fn to_bytes(self) -> [u8; {}] {{",
            s.size
        );
        let _ = writeln!(out, "        let mut bytes = [0u8; {}];", s.size);
        for f in &s.fields {
            let end = f.offset + f.size * f.len.unwrap_or(1);
            if f.size == 1 && f.len.is_some() {
                let _ = writeln!(
                    out,
                    "        bytes[{}..{end}].copy_from_slice(&self.{});",
                    f.offset, f.name
                );
                continue;
            }
            for (i, at) in element_offsets(f) {
                let value = match f.len {
                    Some(_) => format!("self.{}[{i}].to_ne_bytes()", f.name),
                    None => format!("self.{}.to_ne_bytes()", f.name),
                };
                let _ = writeln!(
                    out,
                    "        bytes[{at}..{}].copy_from_slice(&{value});",
                    at + f.size
                );
            }
        }
        out.push_str("        bytes\n    }\n");
    }

    /// `from_bytes`: each field read from its offset.
    fn rust_from_bytes(out: &mut String, s: &Struct, name: &str) {
        let _ = writeln!(out, "    /// The value the kernel map's `bytes` hold.");
        let _ = writeln!(
            out,
            "    pub(crate) fn from_bytes(bytes: &[u8; {}]) -> {name} {{",
            s.size
        );
        let _ = writeln!(out, "        {name} {{");
        for f in &s.fields {
            let word = |at: usize| {
                format!(
                    "u{}::from_ne_bytes(bytes[{at}..{}].try_into().expect(\"{} bytes\"))",
                    f.size * 8,
                    at + f.size,
                    f.size
                )
            };
            let value = match f.len {
                None => word(f.offset),
                Some(n) if f.size == 1 => format!(
                    "bytes[{}..{}].try_into().expect(\"{n} bytes\")",
                    f.offset,
                    f.offset + n
                ),
                Some(_) => {
                    let words: Vec<String> = element_offsets(f)
                        .into_iter()
                        .map(|(_, at)| word(at))
                        .collect();
                    format!("[{}]", words.join(", "))
                }
            };
            let _ = writeln!(out, "            {}: {value},", f.name);
        }
        out.push_str("        }\n    }\n");
    }

    /// Each element's index and byte offset (one for a plain field).
    fn element_offsets(f: &Field) -> Vec<(usize, usize)> {
        (0..f.len.unwrap_or(1))
            .map(|i| (i, f.offset + i * f.size))
            .collect()
    }

    /// The C file whose `_Static_assert`s clang checks against the same layout.
    pub(crate) fn c_asserts(layout: &Layout) -> String {
        let mut out = String::from(
            "// Generated by dataplane/build.rs: the layout build.rs read from offload.h, which\n\
             // maps.rs's types follow, checked against what clang makes of it.\n\
             #include \"offload.h\"\n\n",
        );
        for s in &layout.structs {
            let _ = writeln!(
                out,
                "_Static_assert(sizeof(struct {0}) == {1}, \"struct {0} is {1} bytes in maps.rs\");",
                s.name, s.size
            );
            for f in &s.fields {
                let _ = writeln!(
                    out,
                    "_Static_assert(__builtin_offsetof(struct {0}, {1}) == {2}, \
                     \"{0}.{1} is at byte {2} in maps.rs\");",
                    s.name, f.name, f.offset
                );
            }
        }
        out
    }
}
