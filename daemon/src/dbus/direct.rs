//! Direct connections: `Manager.OpenDirect` hands its caller one end of a socket pair, on
//! which rdmad serves the same objects peer to peer. A call on it goes straight to rdmad
//! instead of through `dbus-daemon` (two hops each way), so it costs about one bus round
//! trip less (docs/dbus-api.md, "Direct connections").
//!
//! The caller's identity is the one the bus vouched for when it called `OpenDirect`: the
//! channel is a socket pair rdmad made, never a socket anyone can connect to, so no
//! credentials need reading from it. Every call on the channel runs as that caller,
//! whatever its header says (`caller.rs` never reads a sender on a direct connection).
//! What is opened on a channel — sessions, and their regions and queue pairs — belongs to
//! the channel (its connection name is the bus name it was opened from with `/direct` and a
//! number appended) and is closed when the channel closes, as a bus connection's sessions
//! are when it leaves the bus.
//!
//! What the bus daemon bounds for a bus connection is bounded here: a user holds at most
//! [`PER_USER`] channels; no message may be longer than [`MAX_MESSAGE_BYTES`] or carry more
//! than [`MAX_MESSAGE_FDS`] descriptors; rdmad reads
//! no more calls from a channel while [`MAX_CALLS`] of its calls, [`MAX_CALL_BYTES`] of
//! their bytes or [`MAX_CALL_FDS`] of their descriptors await their replies (a peer that
//! stops reading its replies stops being read); a call that asks for no reply, or reuses
//! the serial of one awaiting its reply, closes the channel (it would escape that count);
//! and a channel that does not take what rdmad sends it within [`SEND_TIMEOUT`] when an
//! administrator's call must withdraw objects from it is closed.
//!
//! rdmad never calls a method of the peer on a channel: a reply it waited for would have
//! to be read by the reader that [`Flow`] may be holding back.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmad_client::Error;
use zbus::connection::socket::{ReadHalf, Split, WriteHalf};
use zbus::message::{Flags, Message, Type};
use zbus::Connection;

use super::context::Context;
use crate::lock::lock;
use crate::policy::Caller;

/// The most direct connections one user holds at once.
pub const PER_USER: usize = 64;

/// Calls of one direct connection awaiting their replies, beyond which rdmad reads no more
/// of its messages (the system bus's `max_replies_per_connection`).
pub const MAX_CALLS: usize = 128;

/// The bytes of those calls beyond which rdmad reads no more of the connection's messages.
pub const MAX_CALL_BYTES: usize = 8 << 20;

/// The longest message rdmad reads on a direct connection (its calls' arguments are small);
/// a longer one closes the connection before any of it is read.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// The descriptors those calls carry beyond which rdmad reads no more of its messages.
pub const MAX_CALL_FDS: usize = 64;

/// The most descriptors one message may carry (no method of rdmad's takes any): a message
/// that brings more closes the connection as they arrive, before the message is whole.
pub const MAX_MESSAGE_FDS: usize = MAX_CALL_FDS;

/// How long rdmad waits for a direct connection to take what it sends when another
/// caller's work (an administrator withdrawing its objects) waits on it.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// The open direct connections.
#[derive(Default)]
pub struct Channels {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Set when the daemon stops: no channel opens after that.
    closed: bool,
    next: u64,
    open: HashMap<String, Channel>,
}

struct Channel {
    uid: u32,
    /// A second handle on rdmad's end of the socket pair, to shut it down whatever zbus
    /// is doing with it.
    socket: std::os::unix::net::UnixStream,
    /// The channel's connection, once it is served.
    connection: Option<Connection>,
    task: Option<tokio::task::JoinHandle<()>>,
    /// Closed once every object the channel served is gone (the channel's manager holds
    /// the sender): calls still running on it may hold them after the connection closed.
    life: tokio::sync::watch::Receiver<()>,
    flow: Arc<Flow>,
    /// Set once the connection has ended: what was opened on it is being closed, and the
    /// channel stays listed until nothing it served is left.
    closing: bool,
}

impl Channel {
    fn shut(&self) {
        self.flow.break_off();
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

impl Channels {
    /// Whether the channel `name` (a caller's connection name) is open: being served, or
    /// served and not closed.
    pub fn is_open(&self, name: &str) -> bool {
        lock(&self.state)
            .open
            .get(name)
            .is_some_and(|c| !c.closing && c.connection.as_ref().is_none_or(|c| !c.is_closed()))
    }

    /// The connection of channel `name`, while it is open and served.
    pub fn connection_of(&self, name: &str) -> Option<Connection> {
        let state = lock(&self.state);
        let channel = state.open.get(name).filter(|c| !c.closing)?;
        let connection = channel.connection.as_ref()?;
        (!connection.is_closed()).then(|| connection.clone())
    }

    /// Shuts channel `name`'s socket down: its connection ends, and with it what was
    /// opened on it.
    pub fn shut(&self, name: &str) {
        if let Some(channel) = lock(&self.state).open.get(name) {
            channel.shut();
        }
    }

    /// The daemon is stopping: no channel opens any more, and every open one is shut (its
    /// reads and writes fail at once, so nothing waits on a peer). Each channel's task then
    /// closes what was opened on it; [`Channels::wait_all`] waits for that.
    pub fn shut_all(&self) {
        let mut state = lock(&self.state);
        state.closed = true;
        for channel in state.open.values() {
            channel.shut();
        }
    }

    /// Waits, all together and for [`SEND_TIMEOUT`] at most, until every channel's task has
    /// ended and nothing a channel served is left (after [`Channels::shut_all`], and after
    /// the engine ended the waits calls on them may be in).
    pub async fn wait_all(&self) {
        let channels: Vec<Channel> = lock(&self.state).open.drain().map(|(_, c)| c).collect();
        let all = futures_util::future::join_all(channels.into_iter().map(|mut c| async move {
            // Let go of the connection first: the channel's task waits until nothing holds
            // what it served, this included.
            drop(c.connection.take());
            if let Some(task) = c.task.take() {
                let _ = task.await;
            }
            // Err once the manager, and with it every object, is gone.
            while c.life.changed().await.is_ok() {}
        }));
        if tokio::time::timeout(SEND_TIMEOUT, all).await.is_err() {
            tracing::warn!(
                "direct connections' calls did not end within {SEND_TIMEOUT:?} of the stop"
            );
        }
    }

    fn remove(&self, name: &str) -> Option<Channel> {
        lock(&self.state).open.remove(name)
    }
}

/// Whether a caller's connection name is a direct connection's (a bus's unique names hold
/// no `/`).
pub fn is_direct(connection_name: &str) -> bool {
    connection_name.contains('/')
}

/// A GUID for a channel: unique in this daemon's life (the process, its start and a
/// counter), which is all it is for — it names the channel's caller.
fn new_guid() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let start = *START.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(
        "{:08x}{:012x}{:012x}",
        std::process::id(),
        start & 0xffff_ffff_ffff,
        n & 0xffff_ffff_ffff
    )
}

/// Opens a direct connection for `caller` (who called on the bus) and returns the caller's
/// end of it.
pub fn open(ctx: &Arc<Context>, caller: &Caller) -> Result<OwnedFd, Error> {
    if is_direct(&caller.bus_name) {
        return Err(Error::InvalidArgument(
            "OpenDirect is called on the bus: this connection is a direct one already".into(),
        ));
    }
    let guid = new_guid();
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| Error::DeviceError(format!("cannot make a socket pair: {e}")))?;
    let socket = ours
        .try_clone()
        .map_err(|e| Error::DeviceError(format!("cannot duplicate a socket: {e}")))?;
    let stream = ours
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(ours))
        .map_err(|e| Error::DeviceError(format!("cannot serve a direct connection: {e}")))?;
    let (life, life_watch) = tokio::sync::watch::channel(());
    let flow = Arc::new(Flow::default());
    let name = {
        let mut state = lock(&ctx.direct.state);
        if state.closed {
            return Err(Error::DeviceError("rdmad is stopping".into()));
        }
        let held = state.open.values().filter(|c| c.uid == caller.uid).count();
        if held >= PER_USER {
            return Err(Error::QuotaExceeded(format!(
                "user {} holds {held} direct connections, the most one user may hold: close \
                 one (drop its connection) before opening another",
                caller.uid
            )));
        }
        state.next += 1;
        let name = format!("{}/direct{}", caller.bus_name, state.next);
        state.open.insert(
            name.clone(),
            Channel {
                uid: caller.uid,
                socket,
                connection: None,
                task: None,
                life: life_watch.clone(),
                flow: Arc::clone(&flow),
                closing: false,
            },
        );
        name
    };
    let channel_caller = Caller {
        bus_name: name.clone(),
        ..caller.clone()
    };
    ctx.callers.add_direct(&guid, channel_caller.clone());
    let socket = FlowControlled { stream, flow };
    let lives = (life, life_watch);
    let task = tokio::spawn(run(Arc::clone(ctx), channel_caller, guid, socket, lives));
    {
        let mut state = lock(&ctx.direct.state);
        let stopping = state.closed;
        match state.open.get_mut(&name) {
            Some(channel) => channel.task = Some(task),
            // Drained by the daemon stopping: it is not waited for, so it stops here.
            None if stopping => task.abort(),
            // Already over.
            None => {}
        }
    }
    tracing::info!(
        uid = caller.uid,
        sender = %caller.bus_name,
        channel = %name,
        "direct connection opened"
    );
    Ok(OwnedFd::from(theirs))
}

/// Serves one channel until it closes, then closes what was opened on it.
async fn run(
    ctx: Arc<Context>,
    caller: Caller,
    guid: String,
    socket: FlowControlled,
    (life, mut lived): (
        tokio::sync::watch::Sender<()>,
        tokio::sync::watch::Receiver<()>,
    ),
) {
    let name = caller.bus_name.clone();
    let built = async {
        let builder = zbus::connection::Builder::authenticated_socket(socket, guid.as_str())?.p2p();
        super::with_objects(builder, &ctx, Some(life))?
            .build()
            .await
    }
    .await;
    let connection = match built {
        Ok(connection) => connection,
        Err(e) => {
            let closed = matches!(&e, zbus::Error::InputOutput(io)
                if matches!(io.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset));
            if closed {
                tracing::info!(channel = %name, "direct connection closed by its caller before it was served");
            } else {
                tracing::warn!(channel = %name, "cannot serve a direct connection: {e}");
            }
            ctx.direct.remove(&name);
            ctx.callers.forget_direct(&guid);
            return;
        }
    };
    let registered = match lock(&ctx.direct.state).open.get_mut(&name) {
        Some(channel) => {
            channel.connection = Some(connection.clone());
            true
        }
        None => false,
    };
    if registered {
        connection.closed().await;
    }
    // The channel stays listed, closing, until what was opened on it is closed and nothing
    // it served is left — calls still running on it included — so that a stopping daemon
    // waits for all of it.
    if let Some(channel) = lock(&ctx.direct.state).open.get_mut(&name) {
        channel.closing = true;
        channel.connection = None;
    }
    ctx.callers.forget_direct(&guid);
    // The connection is held while its object server is used.
    ctx.connection_gone(connection.object_server(), &name).await;
    drop(connection);
    // Err once the channel's manager, and with it every object it served, is gone.
    while lived.changed().await.is_ok() {}
    ctx.direct.remove(&name);
    tracing::info!(channel = %name, "direct connection closed");
}

/// What a direct connection's calls hold while they await their replies.
#[derive(Debug, Default)]
struct Flow {
    state: Mutex<FlowState>,
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct FlowState {
    /// Serial → (bytes, descriptors) of each call awaiting its reply.
    calls: HashMap<u32, (usize, usize)>,
    bytes: usize,
    fds: usize,
    /// Set once a reply could not be written or the channel was shut: the connection is
    /// ending, and its reader must go on to see it end.
    broken: bool,
}

impl FlowState {
    fn full(&self) -> bool {
        !self.broken
            && (self.calls.len() >= MAX_CALLS
                || self.bytes >= MAX_CALL_BYTES
                || self.fds >= MAX_CALL_FDS)
    }
}

/// Why a message read from a direct connection ends it.
fn refused(why: &str) -> zbus::Error {
    zbus::Error::InputOutput(Arc::new(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("direct connection closed: {why}"),
    )))
}

impl Flow {
    /// Waits until the connection's calls awaiting replies leave room for another.
    async fn room(&self) {
        loop {
            let changed = self.changed.notified();
            if !lock(&self.state).full() {
                return;
            }
            changed.await;
        }
    }

    /// Counts a call read from the peer; refuses what would escape the count: a call that
    /// asks for no reply (it would still run, uncounted) or one reusing the serial of a call
    /// awaiting its reply.
    fn called(&self, message: &Message) -> zbus::Result<()> {
        let header = message.header();
        if header.message_type() != Type::MethodCall {
            return Ok(());
        }
        if header.primary().flags().contains(Flags::NoReplyExpected) {
            return Err(refused("a call asked for no reply"));
        }
        let data = message.data();
        let (bytes, fds) = (data.len(), data.fds().len());
        let serial = header.primary().serial_num().get();
        let mut state = lock(&self.state);
        if state.calls.contains_key(&serial) {
            return Err(refused(
                "a call reused the serial of one awaiting its reply",
            ));
        }
        state.calls.insert(serial, (bytes, fds));
        state.bytes += bytes;
        state.fds += fds;
        Ok(())
    }

    /// A reply left (or failed to: then the connection is ending).
    fn replied(&self, message: &Message, sent: bool) {
        let header = message.header();
        if !matches!(header.message_type(), Type::MethodReturn | Type::Error) {
            if !sent {
                self.break_off();
            }
            return;
        }
        let mut state = lock(&self.state);
        if let Some(serial) = header.reply_serial() {
            if let Some((bytes, fds)) = state.calls.remove(&serial.get()) {
                state.bytes -= bytes;
                state.fds -= fds;
            }
        }
        state.broken |= !sent;
        drop(state);
        self.changed.notify_waiters();
    }

    /// The connection is ending: its reader no longer waits for room.
    fn break_off(&self) {
        lock(&self.state).broken = true;
        self.changed.notify_waiters();
    }
}

/// rdmad's end of a direct connection: a Unix socket whose reading waits while the
/// connection's calls awaiting replies are at their bounds ([`Flow`]).
#[derive(Debug)]
struct FlowControlled {
    stream: tokio::net::UnixStream,
    flow: Arc<Flow>,
}

impl zbus::connection::Socket for FlowControlled {
    type ReadHalf = FlowReader;
    type WriteHalf = FlowWriter;

    fn split(self) -> Split<FlowReader, FlowWriter> {
        let (read, write) = self.stream.into_split();
        Split::new(
            FlowReader {
                inner: Limited::new(read),
                flow: Arc::clone(&self.flow),
            },
            FlowWriter {
                inner: write,
                flow: self.flow,
            },
        )
    }
}

#[derive(Debug)]
struct FlowReader {
    inner: Limited,
    flow: Arc<Flow>,
}

#[async_trait::async_trait]
impl ReadHalf for FlowReader {
    async fn receive_message(
        &mut self,
        seq: u64,
        already_received_bytes: &mut Vec<u8>,
        already_received_fds: &mut Vec<OwnedFd>,
    ) -> zbus::Result<Message> {
        self.flow.room().await;
        let message = self
            .inner
            .receive_message(seq, already_received_bytes, already_received_fds)
            .await?;
        self.flow.called(&message)?;
        Ok(message)
    }

    fn can_pass_unix_fd(&self) -> bool {
        true
    }
}

/// The socket's read half, refusing a message longer than [`MAX_MESSAGE_BYTES`] as soon as
/// its fixed header says so — before zbus makes room for it — and one that brings more than
/// [`MAX_MESSAGE_FDS`] descriptors as soon as they arrive (zbus would keep every descriptor
/// that comes with any part of a message until the message is whole, and a peer sending a
/// message a byte at a time, each with a few hundred descriptors, would fill rdmad's table).
/// zbus reads a message as its 16-byte fixed header, then the rest into a buffer of the
/// length the header gives; reads never cross from one message into the next (the
/// connection is pre-authenticated: nothing was read ahead).
#[derive(Debug)]
struct Limited {
    inner: tokio::net::unix::OwnedReadHalf,
    /// The fixed header of the next message, as far as it is read.
    header: [u8; 16],
    header_read: usize,
    /// Bytes of the current message still to come after its fixed header.
    rest: usize,
    /// Descriptors the current message brought so far.
    fds: usize,
}

impl Limited {
    fn new(inner: tokio::net::unix::OwnedReadHalf) -> Limited {
        Limited {
            inner,
            header: [0; 16],
            header_read: 0,
            rest: 0,
            fds: 0,
        }
    }

    /// A message's whole length from its fixed header (D-Bus: endianness, type, flags,
    /// version, body length, serial, header fields' length; the body starts 8-aligned).
    fn message_len(header: &[u8; 16]) -> usize {
        let word = |at: usize| {
            let bytes = [header[at], header[at + 1], header[at + 2], header[at + 3]];
            if header[0] == b'B' {
                u32::from_be_bytes(bytes)
            } else {
                u32::from_le_bytes(bytes)
            }
        };
        let fields_end = 16 + word(12) as usize;
        fields_end.next_multiple_of(8) + word(4) as usize
    }
}

#[async_trait::async_trait]
impl ReadHalf for Limited {
    async fn recvmsg(&mut self, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
        if self.rest == 0 && self.header_read == 0 {
            // A new message starts.
            self.fds = 0;
        }
        let (n, fds) = self.inner.recvmsg(buf).await?;
        self.fds += fds.len();
        if self.fds > MAX_MESSAGE_FDS {
            // The descriptors close as `fds` drops, those of earlier reads with the
            // connection.
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "direct connection closed: a message brought more than {MAX_MESSAGE_FDS} \
                     descriptors"
                ),
            ));
        }
        if self.rest > 0 {
            self.rest = self.rest.saturating_sub(n);
            return Ok((n, fds));
        }
        let take = n.min(16 - self.header_read);
        self.header[self.header_read..self.header_read + take].copy_from_slice(&buf[..take]);
        self.header_read += take;
        if self.header_read == 16 {
            self.header_read = 0;
            let len = Limited::message_len(&self.header);
            if len > MAX_MESSAGE_BYTES {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "direct connection closed: a message of {len} bytes (at most \
                         {MAX_MESSAGE_BYTES})"
                    ),
                ));
            }
            self.rest = len - 16 - (n - take);
        }
        Ok((n, fds))
    }

    fn can_pass_unix_fd(&self) -> bool {
        true
    }
}

#[derive(Debug)]
struct FlowWriter {
    inner: tokio::net::unix::OwnedWriteHalf,
    flow: Arc<Flow>,
}

#[async_trait::async_trait]
impl WriteHalf for FlowWriter {
    async fn send_message(&mut self, message: &Message) -> zbus::Result<()> {
        let sent = self.inner.send_message(message).await;
        self.flow.replied(message, sent.is_ok());
        sent
    }

    async fn close(&mut self) -> std::io::Result<()> {
        self.inner.close().await
    }

    fn can_pass_unix_fd(&self) -> bool {
        true
    }
}
