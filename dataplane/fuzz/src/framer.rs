//! `framer`: [`uturn_shared::framing::frame_len`] over a byte stream that arrives in pieces,
//! split where the input says, fed the way the stream shell's receive buffer feeds it (append,
//! take every complete frame, keep the incomplete rest).
//!
//! Input: `[cuts: u8][cuts x u16 split offset][stream...]`.
//!
//! Checks: a frame length never exceeds `MAX_FRAME` and covers at least its own header;
//! `Ok(None)` only while fewer than 4 bytes are buffered; the frames, the error and the
//! incomplete tail do not depend on how the stream was split; and they agree with an
//! independent reading of RFC 8656 §12.5 / RFC 8489 §5.
//!
//! The dataplane's own receive buffer (`io::stream::Rx::next_frame`) is `pub(super)` in a
//! private module, so it cannot be reached from here; this emulates it over `frame_len`.

use crate::input::Input;
use uturn_shared::framing::{frame_len, FrameError, MAX_FRAME};

/// How a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The frame starting at this offset cannot be framed: the connection is closed.
    Error(usize, FrameError),
    /// Everything before `start` was framed; the rest is an incomplete frame whose length is
    /// known once its header arrived.
    Incomplete {
        /// Offset of the incomplete frame.
        start: usize,
        /// Its length, when known.
        known: Option<usize>,
    },
}

/// The frames of a stream (offset, length) and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Framing {
    /// Complete frames, in order.
    pub frames: Vec<(usize, usize)>,
    /// The end state.
    pub end: End,
}

/// Frames `pieces` as they arrive, one after the other.
pub fn frame_incrementally(pieces: &[&[u8]]) -> Framing {
    let mut buf: Vec<u8> = Vec::new();
    // Offset in the stream of buf[0].
    let mut base = 0usize;
    let mut start = 0usize;
    let mut frames = Vec::new();
    let mut known = None;
    for piece in pieces {
        buf.extend_from_slice(piece);
        loop {
            let pending = &buf[start..];
            match frame_len(pending) {
                Err(e) => {
                    return Framing {
                        frames,
                        end: End::Error(base + start, e),
                    }
                }
                Ok(None) => {
                    assert!(
                        pending.len() < 4,
                        "frame_len gave Ok(None) with {} bytes buffered: {:02x?}",
                        pending.len(),
                        &pending[..pending.len().min(8)]
                    );
                    known = None;
                    break;
                }
                Ok(Some(n)) => {
                    assert!(n <= MAX_FRAME, "frame length {n} > MAX_FRAME {MAX_FRAME}");
                    let header = if pending[0] >> 6 == 0 { 20 } else { 4 };
                    assert!(n >= header, "frame length {n} shorter than its header");
                    if n > pending.len() {
                        known = Some(n);
                        break;
                    }
                    frames.push((base + start, n));
                    start += n;
                }
            }
        }
        // Keep only the incomplete frame, as the shell does.
        buf.drain(..start);
        base += start;
        start = 0;
    }
    Framing {
        frames,
        end: End::Incomplete { start: base, known },
    }
}

/// RFC 8656 §12.5 read on its own: STUN = 20-byte header + length (a multiple of 4);
/// ChannelData = 4-byte header + length padded to 4; first two bits 0b00 or 0b01.
pub fn reference(stream: &[u8]) -> Framing {
    let mut frames = Vec::new();
    let mut pos = 0;
    loop {
        let rest = &stream[pos..];
        if rest.is_empty() {
            return Framing {
                frames,
                end: End::Incomplete {
                    start: pos,
                    known: None,
                },
            };
        }
        let kind = rest[0] >> 6;
        if kind > 1 {
            return Framing {
                frames,
                end: End::Error(pos, FrameError::NotTurn),
            };
        }
        if rest.len() < 4 {
            return Framing {
                frames,
                end: End::Incomplete {
                    start: pos,
                    known: None,
                },
            };
        }
        let length = usize::from(rest[2]) << 8 | usize::from(rest[3]);
        let n = if kind == 0 {
            if length % 4 != 0 {
                return Framing {
                    frames,
                    end: End::Error(pos, FrameError::BadLength),
                };
            }
            20 + length
        } else {
            4 + length.div_ceil(4) * 4
        };
        if n > rest.len() {
            return Framing {
                frames,
                end: End::Incomplete {
                    start: pos,
                    known: Some(n),
                },
            };
        }
        frames.push((pos, n));
        pos += n;
    }
}

/// The fuzz target.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let cuts = input.u8() % 17;
    let mut points: Vec<usize> = (0..cuts).map(|_| usize::from(input.u16())).collect();
    let stream = input.rest();
    for p in &mut points {
        *p %= stream.len() + 1;
    }
    points.sort_unstable();
    points.dedup();
    let mut pieces: Vec<&[u8]> = Vec::with_capacity(points.len() + 1);
    let mut last = 0;
    for p in points {
        pieces.push(&stream[last..p]);
        last = p;
    }
    pieces.push(&stream[last..]);

    let whole = frame_incrementally(&[stream]);
    let split = frame_incrementally(&pieces);
    assert_eq!(whole, split, "framing depends on how the stream was split");
    // Byte by byte, for short streams (the worst split).
    if stream.len() <= 256 {
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(
            whole,
            frame_incrementally(&bytes),
            "byte-by-byte framing differs"
        );
    }
    assert_eq!(
        whole,
        reference(stream),
        "framer disagrees with RFC 8656 §12.5"
    );
}
