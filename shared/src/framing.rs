//! TURN over a byte stream (TCP, TLS): where one message ends. RFC 8656 §12.5: a STUN message
//! is its 20-byte header plus the length it declares; ChannelData is its 4-byte header plus
//! the payload length, padded to a multiple of 4 over streams. Both the server and the client
//! tools split streams with [`frame_len`].

/// Largest frame [`frame_len`] accepts: a STUN header plus the biggest body a 16-bit length
/// can declare.
pub const MAX_FRAME: usize = 20 + u16::MAX as usize;

/// Why a stream cannot be framed: nothing after this point can be trusted, so the connection
/// should be closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameError {
    /// The first two bits are neither 0b00 (STUN) nor 0b01 (ChannelData).
    NotTurn,
    /// A STUN message whose length is not a multiple of 4 (RFC 8489 §5).
    BadLength,
}

/// The length of the frame at the start of `buf`: `Ok(None)` until enough bytes have arrived
/// to know it, then `Ok(Some(n))` (the frame may still be incomplete: compare `n` with
/// `buf.len()`).
pub fn frame_len(buf: &[u8]) -> Result<Option<usize>, FrameError> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    if buf.len() < 4 {
        return match first >> 6 {
            0b00 | 0b01 => Ok(None),
            _ => Err(FrameError::NotTurn),
        };
    }
    let length = usize::from(u16::from_be_bytes([buf[2], buf[3]]));
    match first >> 6 {
        0b00 if length % 4 != 0 => Err(FrameError::BadLength),
        0b00 => Ok(Some(20 + length)),
        0b01 => Ok(Some(4 + padded(length))),
        _ => Err(FrameError::NotTurn),
    }
}

/// `n` rounded up to a multiple of 4.
pub fn padded(n: usize) -> usize {
    (n + 3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_measured_from_their_headers() {
        type Case = (&'static [u8], Result<Option<usize>, FrameError>);
        let cases: &[Case] = &[
            (&[], Ok(None)),
            (&[0x00, 0x01], Ok(None)),
            (&[0x00, 0x01, 0x00, 0x08], Ok(Some(28))),
            (&[0x00, 0x01, 0x00, 0x06], Err(FrameError::BadLength)),
            (&[0x40, 0x00, 0x00, 0x05], Ok(Some(12))),
            (&[0x40, 0x00, 0x00, 0x00], Ok(Some(4))),
            (&[0x7f, 0xff, 0xff, 0xff], Ok(Some(4 + 65536))),
            (&[0x80], Err(FrameError::NotTurn)),
            (&[0xc0, 0, 0, 0], Err(FrameError::NotTurn)),
        ];
        for (input, want) in cases {
            assert_eq!(frame_len(input), *want, "{input:02x?}");
        }
        assert_eq!(padded(0), 0);
        assert_eq!(padded(1), 4);
        assert_eq!(padded(100), 100);
        assert_eq!(padded(1201), 1204);
    }
}
