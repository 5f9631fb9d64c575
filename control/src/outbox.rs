//! The channel a watcher task reports through. A task sends its own output type (a config, a
//! Service change, a DNS answer); the control loop receives it as its own event. So no task
//! knows the loop's event type, and a task can be tested with a plain channel of its output.

use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// Where a task sends what it finds: cloned freely, closed once the receiver is gone.
pub struct Outbox<T> {
    port: Arc<dyn Port<T>>,
}

/// The receiver of an [`Outbox`] is gone: the task may stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

impl<T: 'static> Outbox<T> {
    /// An outbox that delivers each item into `sender` as the receiver's own type.
    pub fn new<E: From<T> + Send + 'static>(sender: UnboundedSender<E>) -> Outbox<T> {
        Outbox {
            port: Arc::new(sender),
        }
    }

    /// Sends `item`; fails once the receiver is gone.
    pub fn send(&self, item: T) -> Result<(), Closed> {
        self.port.deliver(item)
    }

    /// Whether the receiver is gone.
    pub fn is_closed(&self) -> bool {
        self.port.is_closed()
    }
}

impl<T> Clone for Outbox<T> {
    fn clone(&self) -> Self {
        Outbox {
            port: self.port.clone(),
        }
    }
}

/// A sender of some event type that `T` converts into; erased so that [`Outbox`] names only `T`.
trait Port<T>: Send + Sync {
    fn deliver(&self, item: T) -> Result<(), Closed>;
    fn is_closed(&self) -> bool;
}

impl<T, E: From<T> + Send> Port<T> for UnboundedSender<E> {
    fn deliver(&self, item: T) -> Result<(), Closed> {
        self.send(E::from(item)).map_err(|_| Closed)
    }

    fn is_closed(&self) -> bool {
        UnboundedSender::is_closed(self)
    }
}
