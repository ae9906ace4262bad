//! # clan-proto — communication styles built on clan
//!
//! Layer: above `clan` (apertures, descriptors, mappings, tripwires, event queues, DMA),
//! built from nothing else. No unsafe code. Every style works the same within a host (the
//! bytes move by the processes' own stores into shared memory) and across hosts (over the
//! NIC's links).
//!
//! | module | what it gives | shaped like |
//! |---|---|---|
//! | [`stream`] | connected byte streams: [`stream::Listener`], [`stream::Stream`] (`Read`/`Write`, non-blocking mode, timeouts, shutdown, reads in place, transfer redirection) | `std::net::TcpListener`/`TcpStream` |
//! | [`tokio`] (feature `tokio`) | the same streams for tokio: [`tokio::AsyncListener`], [`tokio::AsyncStream`] (`AsyncRead`/`AsyncWrite`), [`tokio::AsyncEventQueue`] | `tokio::net` |
//! | [`queue`] | the distributed queue: messages (with a meta word) from a [`queue::MsgSender`] to a [`queue::MsgReceiver`], batches, waits on headers | a channel between processes |
//! | [`rpc`] | request/response: [`rpc::RpcClient`] calls, [`rpc::RpcServer`] answers (one channel pair per connection), replies written in place | a minimal RPC |
//! | [`server`] | [`server::EventLoop`]: one thread serving thousands of connections, clan event queues next to other descriptors (mio) | an epoll loop |
//! | [`vmmc`] | SHRIMP's VMMC: export/import of receive buffers, deliberate update (`send_msg`), remote fetch, notifications | the VMMC papers' API |
//!
//! Which one to take: byte streams for code written against sockets; the queue for
//! message passing (the lowest cost per message, batches); RPC for calls that wait for an
//! answer; the event loop for a server with many clients on one thread; VMMC for code written
//! for its buffers and notifications. `clan` itself, underneath, is shared memory with
//! tripwires: the most control, the least help.
//!
//! A stream between two endpoints (here of one process; the address travels to another
//! process or host as a string):
//!
//! ```
//! use std::io::{Read, Write};
//! use clan::{Nic, NicConfig};
//! use clan_proto::stream::{Listener, Stream};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let nic = Nic::open(NicConfig::default())?;
//! let listener = Listener::bind(&nic)?;
//! let addr = listener.local_addr();
//! let server = std::thread::spawn(move || -> std::io::Result<()> {
//!     let (mut s, _peer) = listener.accept_timeout(std::time::Duration::from_secs(5))?;
//!     let mut buf = [0u8; 5];
//!     s.read_exact(&mut buf)?;
//!     s.write_all(&buf)
//! });
//! let mut c = Stream::connect(&nic, addr)?;
//! c.write_all(b"hello")?;
//! let mut back = [0u8; 5];
//! c.read_exact(&mut back)?;
//! assert_eq!(&back, b"hello");
//! server.join().unwrap()?;
//! # Ok(())
//! # }
//! ```
//!
//! Runnable programs for each style are in `crates/clan-proto/examples/`.

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
    send_sync::<queue::Part>();
    send_sync::<queue::Short<u64>>();
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
    send_sync::<stream::StreamStats>();
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
