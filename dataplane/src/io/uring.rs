//! The io_uring engine: one glommio executor per shard. Each socket has a task that waits for
//! it to become readable (a one-byte `MSG_PEEK` through the ring, which glommio first tries as
//! a plain non-blocking call) and then lets the shard drain it with `recvmmsg`.

use super::shard::{Driver, Readiness, Shard, ShardSetup, Token, TICK};
use glommio::net::UdpSocket;
use glommio::{spawn_local, Task};
use socket2::Socket;
use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::rc::{Rc, Weak};
use std::sync::atomic::Ordering;
use std::time::Duration;

pub(super) struct Uring {
    shard: Weak<RefCell<Shard<Uring>>>,
}

impl Driver for Uring {
    type Watch = Task<()>;

    fn watch(&self, socket: Socket, token: Token) -> io::Result<(RawFd, Task<()>)> {
        let fd = socket.as_raw_fd();
        // SAFETY: the fd comes from a socket we own and hand over; glommio closes it when the
        // task (and with it the socket) is dropped.
        let socket = unsafe { UdpSocket::from_raw_fd(socket.into_raw_fd()) };
        Ok((fd, spawn_local(watch(self.shard.clone(), socket, token))))
    }
}

async fn watch(shard: Weak<RefCell<Shard<Uring>>>, socket: UdpSocket, token: Token) {
    let mut probe = [0u8; 1];
    // glommio runs a task as soon as it is spawned, while the shard is still borrowed by
    // whoever opened the socket: wait for data before touching the shard.
    let mut readiness = Readiness::Drained;
    loop {
        match readiness {
            Readiness::More => glommio::yield_if_needed().await,
            Readiness::Drained => {
                if socket.peek_from(&mut probe).await.is_err() {
                    // Nothing on the wire can make this spin: back off a little.
                    glommio::timer::sleep(Duration::from_millis(1)).await;
                }
            }
        }
        let Some(shard) = shard.upgrade() else {
            return;
        };
        let mut s = shard.borrow_mut();
        readiness = s.readable(token);
        s.flush();
    }
}

pub(super) async fn run(setup: ShardSetup) {
    let shard = Rc::new_cyclic(|weak| {
        RefCell::new(Shard::new(
            &setup,
            Uring {
                shard: weak.clone(),
            },
        ))
    });
    while !setup.stop.load(Ordering::Relaxed) {
        shard.borrow_mut().tick(&setup);
        glommio::timer::sleep(TICK).await;
    }
    // Dropping the tasks cancels them and closes every socket.
    shard.borrow_mut().shutdown(&setup.stats[setup.index]);
}
