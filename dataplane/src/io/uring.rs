//! The io_uring backend: one glommio executor per shard. Each socket has a task that waits for
//! it to become readable (a one-byte `MSG_PEEK` through the ring, which glommio first tries as
//! a plain non-blocking call) and then lets the shard drain it with `recvmmsg`. TCP listeners
//! accept through the ring and hand the shard each connection; a connection's task waits with
//! a one-byte peek (which also sees end of stream) and lets the shard read it.

use super::driver::{Driver, Interest, Readiness, Token, Watched, TICK};
use super::shard::{Shard, ShardSetup};
use super::sys;
use crate::proto::ListenerId;
use glommio::net::{TcpListener, TcpStream, UdpSocket};
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

/// A watched socket's task.
pub(super) enum Watch {
    /// Cancelled (closing the socket) when dropped.
    Task(#[allow(dead_code)] Task<()>),
    /// A stream's task, which ends by itself once the shard has shut the connection down.
    Detached,
}

impl Driver for Uring {
    type Watch = Watch;

    fn watch(
        &self,
        socket: Socket,
        token: Token,
        interest: Interest,
    ) -> io::Result<Watched<Watch>> {
        let fd = socket.as_raw_fd();
        let shard = self.shard.clone();
        // SAFETY (all three): the fd comes from a socket we own and hand over; glommio closes
        // it when its task ends or is dropped.
        let watch = match (interest, token) {
            (Interest::Accept, Token::Listener { id, .. }) => {
                let listener = unsafe { TcpListener::from_raw_fd(socket.into_raw_fd()) };
                Watch::Task(spawn_local(accept(shard, listener, fd, id)))
            }
            (Interest::Stream, _) => {
                let stream = unsafe { TcpStream::from_raw_fd(socket.into_raw_fd()) };
                spawn_local(watch_stream(shard, stream, token)).detach();
                Watch::Detached
            }
            _ => {
                let socket = unsafe { UdpSocket::from_raw_fd(socket.into_raw_fd()) };
                Watch::Task(spawn_local(watch(shard, socket, token)))
            }
        };
        Ok(Watched { fd, watch })
    }

    fn want_writable(&self, _fd: RawFd, token: Token, on: bool) {
        if !on {
            return;
        }
        // glommio has no public writability wait: retry every millisecond while bytes are
        // queued (only a client that reads slower than it is sent to gets here).
        let shard = self.shard.clone();
        spawn_local(async move {
            loop {
                glommio::timer::sleep(Duration::from_millis(1)).await;
                let Some(shard) = shard.upgrade() else {
                    return;
                };
                let mut s = lock(&shard).await;
                if !s.write_pending(token) {
                    return;
                }
                let _ = s.readable(token);
                s.flush();
            }
        })
        .detach();
    }
}

/// The shard, once whoever holds it lets go: a task spawned while the shard is borrowed runs
/// at once, and its socket may already be ready.
async fn lock(shard: &RefCell<Shard<Uring>>) -> std::cell::RefMut<'_, Shard<Uring>> {
    loop {
        if let Ok(s) = shard.try_borrow_mut() {
            return s;
        }
        YieldNow { yielded: false }.await;
    }
}

/// Lets every other ready task run once.
struct YieldNow {
    /// Whether it has already let the others run (then it is done).
    yielded: bool,
}

impl std::future::Future for YieldNow {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.yielded {
            return std::task::Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

/// Accepts connections on a TCP listener (whose fd is `listener_fd`) and hands each to the
/// shard.
async fn accept(
    shard: Weak<RefCell<Shard<Uring>>>,
    listener: TcpListener,
    listener_fd: RawFd,
    id: ListenerId,
) {
    loop {
        let stream = match listener.accept().await {
            Ok(stream) => stream,
            Err(e) => {
                let Some(shard) = shard.upgrade() else {
                    return;
                };
                let error = std::io::Error::from(e);
                let refused = lock(&shard).await.accept_failed(listener_fd, &error);
                if !refused {
                    // Back off rather than spin.
                    glommio::timer::sleep(Duration::from_millis(10)).await;
                }
                continue;
            }
        };
        // glommio's stream cannot give its fd up: the shard gets a duplicate, and glommio's
        // copy is closed (the connection stays open through the duplicate).
        let duplicate = sys::duplicate(stream.as_raw_fd());
        drop(stream);
        let Ok(socket) = duplicate else {
            continue;
        };
        let Some(shard) = shard.upgrade() else {
            return;
        };
        lock(&shard).await.accepted(id, socket);
    }
}

/// Waits for a connection's bytes (or its end) and lets the shard read; ends when the shard
/// has closed it.
async fn watch_stream(shard: Weak<RefCell<Shard<Uring>>>, stream: TcpStream, token: Token) {
    let mut probe = [0u8; 1];
    loop {
        // Data, end of stream and errors all wake it: the shard's read tells them apart.
        let peeked = stream.peek(&mut probe).await;
        let Some(shard) = shard.upgrade() else {
            return;
        };
        let readiness = {
            let mut s = lock(&shard).await;
            let readiness = s.readable(token);
            s.flush();
            readiness
        };
        match readiness {
            Readiness::Closed => return,
            Readiness::More => glommio::yield_if_needed().await,
            Readiness::Drained if peeked.is_err() => {
                glommio::timer::sleep(Duration::from_millis(1)).await
            }
            Readiness::Drained => {}
        }
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
            Readiness::Drained | Readiness::Closed => {
                if socket.peek_from(&mut probe).await.is_err() {
                    // Nothing on the wire can make this spin: back off a little.
                    glommio::timer::sleep(Duration::from_millis(1)).await;
                }
            }
        }
        let Some(shard) = shard.upgrade() else {
            return;
        };
        let mut s = lock(&shard).await;
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
