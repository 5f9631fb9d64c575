//! UDP GSO (`UDP_SEGMENT`, Linux 4.18): which consecutive queued datagrams leave as one
//! message, the control message that gives the kernel their segment size, and the fallback.
//! There is no probe before the first send: whether a path can segment (checksum offload on
//! the device, the kernel's version) is learnt from the first GSO message, and a refusal
//! (`EIO`, `EINVAL`, `ENOPROTOOPT`, `EOPNOTSUPP`) turns GSO off for good for that queue, as
//! quinn-udp degrades: the message is sent again one datagram at a time, and so is everything
//! after it.

use std::io;

/// `SOL_UDP` and its `UDP_SEGMENT` option (linux/udp.h), for UDP GSO.
const SOL_UDP: libc::c_int = 17;
const UDP_SEGMENT: libc::c_int = 103;
/// Most segments and bytes in one GSO message (the kernel's UDP_MAX_SEGMENTS and a margin
/// under 64 KiB).
const GSO_SEGMENTS: usize = 64;
const GSO_BYTES: usize = 60_000;

/// Room for one control message carrying the segment size (a `cmsghdr` and a `u16`).
pub(crate) type Control = [u64; 4];

/// Whether a queue sends runs to one destination as GSO messages: on until the kernel
/// refuses GSO once.
pub(crate) struct Gso {
    on: bool,
}

impl Gso {
    /// GSO on (tried until refused) or off.
    pub(crate) fn new(on: bool) -> Gso {
        Gso { on }
    }

    /// Whether runs still go as GSO messages.
    #[cfg(test)]
    pub(crate) fn is_on(&self) -> bool {
        self.on
    }

    /// The end of the message that starts at queued datagram `start`, within `start..end`
    /// (all on one socket): with GSO, the datagrams after it that go to the same destination
    /// (`same_destination(j)`) with the same length (`len(j)`; the last of the run may be
    /// shorter, none empty), within the kernel's segment and byte limits; without, `start + 1`.
    pub(crate) fn message_end(
        &self,
        start: usize,
        end: usize,
        len: impl Fn(usize) -> usize,
        same_destination: impl Fn(usize) -> bool,
    ) -> usize {
        let size = len(start);
        let mut j = start + 1;
        let mut bytes = size;
        while self.on
            && j < end
            && j - start < GSO_SEGMENTS
            && len(j - 1) == size
            && len(j) <= size
            && len(j) > 0
            && bytes + len(j) <= GSO_BYTES
            && same_destination(j)
        {
            bytes += len(j);
            j += 1;
        }
        j
    }

    /// Points `header` at `control`, filled with a `UDP_SEGMENT` of `size` when the message
    /// carries `datagrams` > 1, or at no control message.
    pub(crate) fn set_segment(
        header: &mut libc::msghdr,
        control: &mut Control,
        datagrams: usize,
        size: usize,
    ) {
        if datagrams < 2 {
            header.msg_control = std::ptr::null_mut();
            header.msg_controllen = 0;
            return;
        }
        // SAFETY: `control` is big and aligned enough for one cmsghdr carrying a u16.
        unsafe {
            let cmsg = control.as_mut_ptr().cast::<libc::cmsghdr>();
            (*cmsg).cmsg_level = SOL_UDP;
            (*cmsg).cmsg_type = UDP_SEGMENT;
            (*cmsg).cmsg_len = libc::CMSG_LEN(2) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<u16>(), size as u16);
            header.msg_control = control.as_mut_ptr().cast();
            header.msg_controllen = libc::CMSG_SPACE(2) as _;
        }
    }

    /// `sendmmsg` failed with `error` on a message of `datagrams`: true if that was the
    /// kernel refusing GSO, which is then off for good (send the message again).
    pub(crate) fn refused(&mut self, error: &io::Error, datagrams: usize) -> bool {
        let unsupported = matches!(
            error.raw_os_error(),
            Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
        );
        if datagrams > 1 && self.on && unsupported {
            // This path cannot segment (no checksum offload, or too old a kernel): from now
            // on, one datagram per message.
            self.on = false;
            tracing::debug!(target: "stunner", "UDP GSO unavailable ({error}); sending datagrams one by one");
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where each message of `lens` (all to one destination unless `to` differs) ends.
    fn messages(gso: &Gso, lens: &[usize], to: &[u8]) -> Vec<usize> {
        let mut ends = Vec::new();
        let mut start = 0;
        while start < lens.len() {
            start = gso.message_end(start, lens.len(), |i| lens[i], |j| to[j] == to[start]);
            ends.push(start);
        }
        ends
    }

    #[test]
    fn a_run_of_one_size_to_one_destination_is_one_message_ended_by_a_shorter_datagram() {
        let gso = Gso::new(true);
        let lens = [300, 300, 300, 120, 300, 300, 200, 200, 100];
        let to = [0, 0, 0, 0, 1, 1, 1, 1, 0];
        // The 200 B tail ends the second run; the next 200 B starts a third, a new destination
        // a fourth.
        assert_eq!(messages(&gso, &lens, &to), [4, 7, 8, 9]);
        // Off: one datagram per message.
        assert_eq!(
            messages(&Gso::new(false), &lens, &to),
            (1..=9).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_message_holds_at_most_64_segments_and_60000_bytes_and_no_empty_datagram() {
        let gso = Gso::new(true);
        assert_eq!(messages(&gso, &[10; 100], &[0; 100]), [64, 100]);
        // 1200-byte segments: 50 fit in 60 000 bytes.
        assert_eq!(messages(&gso, &[1200; 60], &[0; 60]), [50, 60]);
        assert_eq!(messages(&gso, &[10, 0, 10], &[0; 3]), [1, 2, 3]);
    }

    #[test]
    fn the_kernel_refusing_gso_turns_it_off_for_good_and_other_errors_do_not() {
        let mut gso = Gso::new(true);
        let full = io::Error::from_raw_os_error(libc::EAGAIN);
        assert!(!gso.refused(&full, 4));
        let refused = io::Error::from_raw_os_error(libc::EIO);
        assert!(!gso.refused(&refused, 1), "a single datagram is no GSO");
        assert!(gso.is_on());
        assert!(gso.refused(&refused, 4));
        assert!(!gso.is_on());
        assert!(
            !gso.refused(&refused, 4),
            "already off: the error is the datagram's"
        );
    }
}
