//! # clan-proto — communication styles built on clan
//!
//! Layer: above `clan` (apertures, descriptors, mappings, tripwires, event queues, DMA),
//! built from nothing else. No unsafe code.
//!
//! - [`vmmc`]: the virtual memory-mapped communication model of Princeton's SHRIMP project —
//!   export/import of receive buffers with importer restrictions, deliberate update
//!   (`send_msg`, synchronous and asynchronous, short messages by programmed I/O and long
//!   ones by DMA), remote fetch, and notifications.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod queue;
pub mod rpc;
pub mod server;
pub mod stream;
pub mod vmmc;

#[cfg(feature = "tokio")]
pub mod tokio;

/// Lock `m`, taking the data of a poisoned lock as it is (a panic in another thread must not
/// make every later call on the same stream or buffer panic too).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

mod inplace;
mod pipe;
mod side;
mod wait;

pub use inplace::InPlace;
pub use pipe::Redirection;
pub use side::SetupError;

/// Every public type is `Send` and `Sync` (checked at compile time), except
/// [`server::EventLoop`]: it holds the callbacks it was given, which may capture anything
/// (an `Rc`, a `RefCell`), and runs them on the thread that drives it, so it is neither, by
/// design: make one per thread.
const _: () = {
    const fn send_sync<T: Send + Sync + ?Sized>() {}
    send_sync::<InPlace<'static>>();
    send_sync::<Redirection>();
    send_sync::<SetupError>();
    send_sync::<queue::QueueConfig>();
    send_sync::<queue::QueueError>();
    send_sync::<queue::Header>();
    send_sync::<queue::Message>();
    send_sync::<queue::QueueListener>();
    send_sync::<queue::MsgSender>();
    send_sync::<queue::MsgReceiver>();
    send_sync::<rpc::RpcError>();
    send_sync::<rpc::RpcConfig>();
    send_sync::<rpc::Writer<'static>>();
    send_sync::<rpc::RpcListener>();
    send_sync::<rpc::ChannelSender>();
    send_sync::<rpc::ChannelReceiver>();
    send_sync::<rpc::RpcClient>();
    send_sync::<rpc::ConnId>();
    send_sync::<rpc::RpcServer>();
    send_sync::<stream::StreamConfig>();
    send_sync::<stream::Listener>();
    send_sync::<stream::Stream>();
    send_sync::<stream::Readiness>();
    send_sync::<stream::HandOver>();
    send_sync::<stream::TakeOver>();
    send_sync::<vmmc::VmmcError>();
    send_sync::<vmmc::VmmcConfig>();
    send_sync::<vmmc::Notification>();
    send_sync::<vmmc::Notify>();
    send_sync::<vmmc::ExportOptions>();
    send_sync::<vmmc::SendFlags>();
    send_sync::<vmmc::VmmcStats>();
    send_sync::<vmmc::Vmmc>();
    send_sync::<vmmc::ExportedBuffer>();
    send_sync::<vmmc::SendBuffer>();
    send_sync::<vmmc::ImportedBuffer>();
    send_sync::<vmmc::TransferHandle>();
    #[cfg(feature = "tokio")]
    {
        send_sync::<tokio::AsyncEventQueue>();
        send_sync::<tokio::Reactor>();
        send_sync::<tokio::AsyncListener>();
        send_sync::<tokio::AsyncStream>();
    }
};
