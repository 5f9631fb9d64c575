//! A cursor over fuzzer input that never fails: past the end every read gives zeros (or an
//! empty slice), so every input, however short, is a valid program.

/// Reads fields from the front of the input.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// Whether everything has been read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.data.len()
    }

    /// One byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    /// A big-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.array())
    }

    /// `N` bytes, zero-padded past the end.
    pub fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let taken = self.bytes(N);
        out[..taken.len()].copy_from_slice(taken);
        out
    }

    /// Up to `n` bytes (fewer at the end).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    /// A u16 length, then that many bytes (at most `max`, fewer at the end).
    pub fn len_prefixed(&mut self, max: usize) -> &'a [u8] {
        let n = usize::from(self.u16()).min(max);
        self.bytes(n)
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

/// Writes fields in the layout [`Input`] reads (for seeds).
#[derive(Default)]
pub struct Output {
    /// The bytes written so far.
    pub bytes: Vec<u8>,
}

impl Output {
    /// An empty buffer.
    pub fn new() -> Self {
        Output::default()
    }

    /// One byte.
    pub fn u8(&mut self, b: u8) -> &mut Self {
        self.bytes.push(b);
        self
    }

    /// A big-endian u16.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// Raw bytes.
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.bytes.extend_from_slice(b);
        self
    }

    /// A u16 length, then the bytes.
    pub fn len_prefixed(&mut self, b: &[u8]) -> &mut Self {
        self.u16(u16::try_from(b.len()).expect("seed field too long"));
        self.raw(b)
    }
}
