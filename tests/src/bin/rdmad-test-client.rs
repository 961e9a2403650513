//! A scriptable rdmad client for the integration tests, run as any uid. It reads one
//! command per line on stdin and answers one JSON line per command on stdout:
//! `{"ok": …}` or `{"error": "<D-Bus error name>", "message": "…"}`.
//!
//! Commands (regions are numbered from 0 in the order this client got them):
//!   open                          → session path
//!   alloc POOL SIZE               → [region path, size]
//!   write N OFFSET TEXT           → null          (through the client's mapping)
//!   read N OFFSET LEN             → text
//!   blocks N                      → the blocks region N's memfd still has allocated
//!   touch N BYTE                  → null          (a byte in every page, through the mapping)
//!   share N ro|rw [SECONDS]       → [token, key id]
//!   attach TOKEN                  → [region path, size, access]
//!   maprw N                       → null, or the mmap error (maps region N writable again)
//!   reopenrw N                    → null, or the error reopening its fd read-write via /proc
//!   free N | detach N | info N    → null | null | RegionInfo
//!   revoke N KEY | revoke-any KEY → null
//!   close                         → null
//!   session-info PATH | close-session PATH | alloc-in PATH POOL SIZE
//!   qp DEVICE [SEND_DEPTH [RECV_DEPTH [MAX_INLINE]]] → [qp path, ring size, sq entries, cq entries]
//!   endpoint N | qpinfo N | destroy N | flush N | connect N ENDPOINT-JSON   (N: index or qp path)
//!   connect-to N ADDRESS PORT [PRIVATE_DATA] → the connection (address, port, local_address,
//!                                 local_port, qp_num, private_data as text)
//!   listen ADDRESS PORT [BACKLOG [PRIVATE_DATA]] → [listener, address, port]
//!   accept L [TIMEOUT_MS]         → [qp path, connection]: the new QP joins this client's
//!   stop-listening L              → null
//!   post Q OP REGION OFFSET LEN WRID [REMOTE_ADDR RKEY [ARG [SWAP]]]
//!                                 (OP: send recv write read fadd cswap, send:IMM and
//!                                 write:IMM with immediate data; ARG: fadd's addend
//!                                 (default 1) or cswap's compare value;
//!                                 REGION: index of a held region, or #ID for any id)
//!   post-garbage Q WRID | bad-tail Q [N] | wait Q → completion JSON (60 s at most)
//!                                 (bad-tail: the Nth impossible submission tail in a row)
//!   export N Q [ACCESS] → [addr, rkey, len, export id] | unexport N EXPORT
//!   exports-unanswered COUNT N Q  → COUNT: that many `ExportRemote(Q)` calls of region N
//!                                 sent at once, their replies never awaited
//!   sessions | regions | pools | qps | devices | quota UID | reload
//!   rtt QA QB REGION COUNT        → {median_us, p99_us, max_us, count}: COUNT 64-byte
//!                                 SEND round trips between two of this client's QPs
//!                                 (connected to each other), through region REGION
//!   read-u64 N OFFSET | write-u64 N OFFSET VALUE → a little-endian u64 | null
//!   rping-adv N OFFSET ADDR RKEY SIZE | rping-info N OFFSET → null | {buf, rkey, size}:
//!                                 rping's buffer advertisement (16 bytes, big-endian)
//!   stream Q REGION COUNT LEN REMOTE_ADDR RKEY → {bytes, seconds, mb_per_s}: COUNT
//!                                 LEN-byte RDMA WRITEs, all completed, 16 in flight; the
//!                                 first failed one ends it (an error naming its status)
//!   flood Q REGION COUNT LEN REMOTE_ADDR RKEY → how many LEN-byte RDMA WRITEs were queued
//!                                 (unsignaled but the last; completions are not awaited)
//!   attack-fds Q                  → what was done to QP Q's doorbell and completion
//!                                 descriptors: blocking mode, full pipes, dups, reopens
//!   punch-ring Q | punch N        → {punch, truncate}: fallocate(PUNCH_HOLE) over the
//!                                 whole ring or region memfd, then ftruncate(0) (errors
//!                                 as strings, null where it worked)
//!   directs N                     → {opened, then?}: opens and holds N more direct
//!                                 connections (`then`: the error that stopped it)
//!   drop-directs | open-direct-on-direct → null (closes those held | OpenDirect asked on
//!                                 the connection the client calls on)
//!   objects                       → the object paths the calls' connection serves
//!   whoami                        → this client's unique name on the bus
//!   forged SENDER METHOD          → Manager.METHOD() (ListSessions: the uids listed;
//!                                 Reload) sent with a made-up sender header
//!   raw-direct noreply|huge|fds   → "closed" if rdmad closes a fresh direct connection
//!                                 after a call that wants no reply / announces 100 MiB /
//!                                 comes a byte at a time, each with 253 descriptors
//!   flood-direct N                → how many of N ListDevices calls went out on a fresh
//!                                 direct connection's raw socket, never reading a reply
//!                                 (the socket stays open)
//!   watch                         → the unique name of rdmad now (starts a DaemonWatch)
//!   gone                          → {previous, current, message} once that rdmad left
//!   exit
//!
//! With `RDMAD_TEST_DIRECT` set, the client makes every call but `watch` and `gone` on a
//! direct connection (`rdmad_client::connect_direct`), not through the bus.

use std::io::BufRead;
use std::os::fd::OwnedFd;

use rdmad_client::proxy::{ManagerProxy, Options, QueuePairProxy, RegionProxy, SessionProxy};
use rdmad_client::queue_pair::QueuePairRing;
use rdmad_client::ring::{Opcode, RegionSge, Submission};
use rdmad_client::types::Endpoint;
use rdmad_client::{DaemonWatch, Error, RegionMapping};
use serde_json::{json, Value};
use zbus::zvariant::{OwnedObjectPath, Value as ZValue};

/// Copies of a QP's descriptors, for attacks on them (the ring keeps its own).
struct RingFds {
    ring: OwnedFd,
    doorbell: OwnedFd,
    completions: OwnedFd,
}

fn io_result<T>(r: nix::Result<T>) -> Value {
    match r {
        Ok(_) => Value::Null,
        Err(e) => json!(e.to_string()),
    }
}

/// `fallocate(PUNCH_HOLE)` over the whole of `fd`, then `ftruncate(fd, 0)`.
fn punch_and_truncate(fd: &OwnedFd) -> Value {
    use std::os::fd::AsRawFd;
    let len = nix::sys::stat::fstat(fd.as_raw_fd()).map_or(0, |s| s.st_size);
    let punch = nix::fcntl::fallocate(
        fd.as_raw_fd(),
        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
        0,
        len,
    );
    let truncate = nix::unistd::ftruncate(fd, 0);
    json!({"punch": io_result(punch), "truncate": io_result(truncate)})
}

/// Everything a client can do to its wake-up descriptors to hurt whoever shares them:
/// fill the doorbell pipe, write an eventfd's "counter almost full" value, try to reopen
/// both ends through `/proc/self/fd` (to fill the completion channel too), switch its ends
/// to blocking mode, keep dups and close some.
fn attack_fds(fds: &RingFds) -> Value {
    use std::os::fd::AsRawFd;
    let mut report = serde_json::Map::new();
    let mut filled = 0u64;
    let chunk = [0xffu8; 4096];
    while let Ok(n) = nix::unistd::write(&fds.doorbell, &chunk) {
        filled += n as u64;
    }
    report.insert("doorbell_filled".into(), json!(filled));
    let _ = nix::unistd::write(&fds.doorbell, &0xffff_ffff_ffff_fffeu64.to_ne_bytes());
    for (name, fd, write) in [
        ("doorbell", &fds.doorbell, false),
        ("completions", &fds.completions, true),
    ] {
        let reopened = std::fs::OpenOptions::new()
            .read(!write)
            .write(write)
            .open(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        report.insert(
            format!("{name}_reopened"),
            match reopened {
                Ok(file) => {
                    std::mem::forget(file);
                    Value::Null
                }
                Err(e) => json!(e.to_string()),
            },
        );
        let cleared = nix::fcntl::fcntl(
            fd.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
        );
        report.insert(format!("{name}_blocking"), io_result(cleared));
    }
    let dups: Vec<OwnedFd> = [&fds.doorbell, &fds.completions, &fds.ring]
        .iter()
        .filter_map(|fd| fd.try_clone().ok())
        .collect();
    report.insert("dups".into(), json!(dups.len()));
    // Keep two, close one.
    let mut dups = dups.into_iter();
    drop(dups.next());
    std::mem::forget(dups.collect::<Vec<_>>());
    Value::Object(report)
}

struct Held {
    path: OwnedObjectPath,
    fd: OwnedFd,
    size: u64,
    mapping: Option<RegionMapping>,
}

fn error_json(e: Error) -> Value {
    match e {
        Error::ZBus(zbus::Error::MethodError(ref name, _, _)) => {
            json!({"error": name.as_str(), "message": e.message()})
        }
        Error::ZBus(other) => json!({"error": "transport", "message": other.to_string()}),
        other => json!({"error": other.dbus_name(), "message": other.message()}),
    }
}

async fn region<'a>(
    c: &zbus::Connection,
    path: &OwnedObjectPath,
) -> Result<RegionProxy<'a>, Error> {
    Ok(RegionProxy::builder(c).path(path.clone())?.build().await?)
}

/// A new queue pair's descriptors as `CreateQueuePair` and `Accept` hand them out: kept
/// (for the attacks on them) and mapped as its ring.
fn map_ring(
    ring: zbus::zvariant::OwnedFd,
    doorbell: zbus::zvariant::OwnedFd,
    completion: zbus::zvariant::OwnedFd,
    info: rdmad_client::types::RingInfo,
) -> Result<(RingFds, QueuePairRing), Error> {
    let (ring, doorbell, completions): (OwnedFd, OwnedFd, OwnedFd) =
        (ring.into(), doorbell.into(), completion.into());
    let fds = RingFds {
        ring: ring.try_clone().expect("dup"),
        doorbell: doorbell.try_clone().expect("dup"),
        completions: completions.try_clone().expect("dup"),
    };
    let ring = QueuePairRing::new(ring, doorbell, completions, info)
        .map_err(|e| Error::InvalidArgument(format!("ring: {e}")))?;
    Ok((fds, ring))
}

/// The most WRITEs `stream` keeps in flight.
const STREAM_IN_FLIGHT: u64 = 16;

/// A connection's description as JSON, its private data as text (up to a NUL).
fn connection_json(d: &std::collections::HashMap<String, zbus::zvariant::OwnedValue>) -> Value {
    let mut out = serde_json::Map::new();
    for (key, v) in d {
        let value = match &**v {
            ZValue::Str(s) => json!(s.as_str()),
            ZValue::U16(n) => json!(n),
            ZValue::U32(n) => json!(n),
            ZValue::Array(a) => {
                let bytes: Vec<u8> = a
                    .iter()
                    .filter_map(|b| match b {
                        ZValue::U8(b) => Some(*b),
                        _ => None,
                    })
                    .collect();
                let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
                json!(String::from_utf8_lossy(&bytes[..end]))
            }
            other => json!(format!("{other:?}")),
        };
        out.insert(key.clone(), value);
    }
    Value::Object(out)
}

async fn qp_proxy<'a>(c: &zbus::Connection, path: &str) -> Result<QueuePairProxy<'a>, Error> {
    Ok(QueuePairProxy::builder(c)
        .path(path.to_owned())?
        .build()
        .await?)
}

/// Calls `Manager.METHOD()` (`ListSessions` or `Reload`) on `c` with a made-up `sender`
/// header: what a peer can write on a direct connection. `ListSessions` answers the uids of
/// the sessions it lists.
async fn forged_call(c: &zbus::Connection, sender: &str, method: &str) -> Result<Value, Error> {
    use futures_util::StreamExt;
    let message = zbus::message::Message::method_call(rdmad_client::MANAGER_PATH, method)?
        .sender(sender)?
        .destination(rdmad_client::BUS_NAME)?
        .interface("org.rdmad1.Manager")?
        .build(&())?;
    let serial = message.primary_header().serial_num();
    let mut replies = zbus::MessageStream::from(c);
    c.send(&message).await?;
    while let Some(reply) = replies.next().await {
        let reply = reply?;
        if reply.header().reply_serial() != Some(serial) {
            continue;
        }
        if reply.message_type() == zbus::message::Type::Error {
            return Err(Error::ZBus(zbus::Error::from(reply)));
        }
        return Ok(match method {
            "ListSessions" => {
                let sessions: Vec<rdmad_client::types::SessionInfo> = reply.body().deserialize()?;
                json!(sessions.iter().map(|s| s.uid).collect::<Vec<_>>())
            }
            _ => Value::Null,
        });
    }
    Err(Error::InvalidArgument(
        "the connection closed before the reply".into(),
    ))
}

/// Opens a direct connection and writes up to `n` `Manager.ListDevices` calls on its raw socket
/// without ever reading a reply, until the socket takes nothing more for half a second;
/// returns how many were written in full, and the socket (kept open, unread, by the
/// caller).
async fn flood_direct(
    manager: &ManagerProxy<'_>,
    n: u64,
) -> Result<(u64, std::os::unix::net::UnixStream), Error> {
    use std::io::Write;
    let fd = manager.open_direct(Options::new()).await?;
    let mut socket = std::os::unix::net::UnixStream::from(OwnedFd::from(fd));
    socket
        .set_nonblocking(true)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let mut written = 0;
    while written < n {
        let ping = zbus::message::Message::method_call(rdmad_client::MANAGER_PATH, "ListDevices")?
            .interface("org.rdmad1.Manager")?
            .build(&())?;
        let bytes: &[u8] = ping.data();
        let mut at = 0;
        while at < bytes.len() {
            match socket.write(&bytes[at..]) {
                Ok(k) => at += k,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // Full: wait for rdmad to read on, up to half a second.
                    use std::os::fd::AsFd;
                    let mut fds = [nix::poll::PollFd::new(
                        socket.as_fd(),
                        nix::poll::PollFlags::POLLOUT,
                    )];
                    match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(500u16)) {
                        Ok(0) => return Ok((written, socket)),
                        Ok(_) => {}
                        Err(e) => return Err(Error::InvalidArgument(format!("poll: {e}"))),
                    }
                }
                Err(e) => return Err(Error::InvalidArgument(format!("writing: {e}"))),
            }
        }
        written += 1;
    }
    Ok((written, socket))
}

/// Opens a direct connection and writes one message on its raw socket: `noreply`, a
/// `ListDevices` call flagged as wanting no reply; `huge`, one whose header announces a
/// 100 MiB body. Answers `"closed"` if rdmad then closes the connection (within a minute).
async fn raw_direct(manager: &ManagerProxy<'_>, kind: &str) -> Result<Value, Error> {
    use std::io::{Read, Write};
    let fd = manager.open_direct(Options::new()).await?;
    let mut socket = std::os::unix::net::UnixStream::from(OwnedFd::from(fd));
    let call = zbus::message::Message::method_call(rdmad_client::MANAGER_PATH, "ListDevices")?
        .interface("org.rdmad1.Manager")?;
    let bytes = match kind {
        "noreply" => call
            .with_flags(zbus::message::Flags::NoReplyExpected)?
            .build(&())?
            .data()
            .to_vec(),
        "huge" => {
            let mut bytes = call.build(&())?.data().to_vec();
            // The body length, in the message's own byte order (zbus writes little-endian).
            bytes[4..8].copy_from_slice(&(100u32 << 20).to_le_bytes());
            bytes
        }
        "fds" => {
            // A call announcing a 1 MiB body, then its bytes one at a time, each with 253
            // descriptors (the most one sendmsg carries), until rdmad closes the connection
            // or 40 have gone: over 10,000 descriptors for a message never finished.
            use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
            use std::io::IoSlice;
            use std::os::fd::AsRawFd;
            let mut bytes = call.build(&())?.data().to_vec();
            bytes[4..8].copy_from_slice(&(1u32 << 20).to_le_bytes());
            let io = |e: std::io::Error| Error::InvalidArgument(e.to_string());
            socket.write_all(&bytes[..16]).map_err(io)?;
            let null = std::fs::File::open("/dev/null").map_err(io)?;
            let fds = vec![null.as_raw_fd(); 253];
            for _ in 0..40 {
                let sent = sendmsg::<()>(
                    socket.as_raw_fd(),
                    &[IoSlice::new(&[0])],
                    &[ControlMessage::ScmRights(&fds)],
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                );
                if sent.is_err() {
                    break;
                }
            }
            Vec::new()
        }
        other => return Err(Error::InvalidArgument(format!("raw-direct {other}?"))),
    };
    let io = |e: std::io::Error| Error::InvalidArgument(e.to_string());
    socket.write_all(&bytes).map_err(io)?;
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .map_err(io)?;
    // rdmad's signals (its objects, as the connection starts) may come first: what
    // matters is whether the connection then ends — with an end of file, or a reset when
    // rdmad closed it with the rest of the message still unread.
    let mut answer = Vec::new();
    match socket.read_to_end(&mut answer) {
        Ok(_) => Ok(json!("closed")),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(json!("closed")),
        Err(e) => Ok(json!(format!(
            "still open after {} bytes: {e}",
            answer.len()
        ))),
    }
}

async fn session_proxy<'a>(c: &zbus::Connection, path: &str) -> Result<SessionProxy<'a>, Error> {
    Ok(SessionProxy::builder(c)
        .path(path.to_owned())?
        .build()
        .await?)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let address = std::env::var("RDMAD_BUS_ADDRESS").expect("RDMAD_BUS_ADDRESS");
    let bus = zbus::connection::Builder::address(address.as_str())
        .expect("address")
        .build()
        .await
        .expect("connect");
    // RDMAD_TEST_DIRECT: every call but `watch`/`gone` on a direct connection instead.
    let c = if std::env::var_os("RDMAD_TEST_DIRECT").is_some() {
        rdmad_client::connect_direct(&bus)
            .await
            .expect("a direct connection")
    } else {
        bus.clone()
    };
    let manager = ManagerProxy::new(&c).await.expect("manager proxy");
    let mut session: Option<String> = None;
    let mut held: Vec<Held> = Vec::new();
    let mut qps: Vec<String> = Vec::new();
    let mut rings: Vec<QueuePairRing> = Vec::new();
    let mut ring_fds: Vec<RingFds> = Vec::new();
    let mut watch: Option<DaemonWatch> = None;
    let mut directs: Vec<zbus::Connection> = Vec::new();
    let mut flooded: Vec<std::os::unix::net::UnixStream> = Vec::new();
    let manager_on_bus = ManagerProxy::new(&bus).await.expect("manager proxy");

    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&cmd, args)) = words.split_first() else {
            continue;
        };
        let arg = |i: usize| args.get(i).copied().unwrap_or("");
        let num = |i: usize| arg(i).parse::<u64>().unwrap_or(u64::MAX);
        let result: Result<Value, Error> = async {
            match cmd {
                "open" => {
                    let path = manager.open_session(Options::new()).await?;
                    session = Some(path.to_string());
                    Ok(json!(path.as_str()))
                }
                "alloc" | "alloc-in" => {
                    let (spath, pool, size) = if cmd == "alloc" {
                        (session.clone().unwrap_or_default(), arg(0), num(1))
                    } else {
                        (arg(0).to_owned(), arg(1), num(2))
                    };
                    let s = session_proxy(&c, &spath).await?;
                    let (path, fd, size) = s.allocate_region(pool, size, Options::new()).await?;
                    let fd: OwnedFd = fd.into();
                    let mapping =
                        RegionMapping::map(fd.try_clone().expect("dup"), size as usize, true).ok();
                    held.push(Held {
                        path: path.clone(),
                        fd,
                        size,
                        mapping,
                    });
                    Ok(json!([path.as_str(), size]))
                }
                "attach" => {
                    let s = session_proxy(&c, session.as_deref().unwrap_or_default()).await?;
                    let (path, fd, size, access) = s.attach_region(arg(0), Options::new()).await?;
                    let fd: OwnedFd = fd.into();
                    let mapping = RegionMapping::map(
                        fd.try_clone().expect("dup"),
                        size as usize,
                        access == "rw",
                    )
                    .ok();
                    held.push(Held {
                        path: path.clone(),
                        fd,
                        size,
                        mapping,
                    });
                    Ok(json!([path.as_str(), size, access]))
                }
                "write" => {
                    let h = &held[num(0) as usize];
                    let m = h.mapping.as_ref().expect("mapped");
                    Ok(match m.write(num(1) as usize, arg(2).as_bytes()) {
                        Ok(()) => Value::Null,
                        Err(e) => json!({"io_error": e.to_string()}),
                    })
                }
                "blocks" => {
                    // blocks N: the 512-byte blocks the region's file still has allocated.
                    use std::os::fd::AsRawFd;
                    let stat = nix::sys::stat::fstat(held[num(0) as usize].fd.as_raw_fd())
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    Ok(json!(stat.st_blocks))
                }
                "touch" => {
                    // touch N BYTE: one byte in every page, through the client's mapping, so
                    // every page of the region is allocated.
                    let h = &held[num(0) as usize];
                    let mapping = h.mapping.as_ref().expect("mapped");
                    for page in (0..h.size as usize).step_by(4096) {
                        mapping
                            .write(page, &[num(1) as u8])
                            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    }
                    Ok(Value::Null)
                }
                "read" => {
                    let h = &held[num(0) as usize];
                    let mut buf = vec![0u8; num(2) as usize];
                    h.mapping
                        .as_ref()
                        .expect("mapped")
                        .read(num(1) as usize, &mut buf)
                        .expect("read");
                    Ok(json!(String::from_utf8_lossy(&buf)))
                }
                "maprw" => {
                    let h = &held[num(0) as usize];
                    Ok(
                        match RegionMapping::map(
                            h.fd.try_clone().expect("dup"),
                            h.size as usize,
                            true,
                        ) {
                            Ok(_) => Value::Null,
                            Err(e) => json!({"io_error": e.to_string()}),
                        },
                    )
                }
                "reopenrw" => {
                    use std::os::fd::AsRawFd;
                    let h = &held[num(0) as usize];
                    let path = format!("/proc/self/fd/{}", h.fd.as_raw_fd());
                    Ok(
                        match std::fs::OpenOptions::new()
                            .read(true)
                            .write(true)
                            .open(path)
                        {
                            Ok(_) => Value::Null,
                            Err(e) => json!({"io_error": e.to_string()}),
                        },
                    )
                }
                "share" => {
                    let mut options = Options::new();
                    options.insert("access", ZValue::from(arg(1)));
                    if !arg(2).is_empty() {
                        options.insert("expires_in", ZValue::from(num(2)));
                    }
                    let (token, key) = region(&c, &held[num(0) as usize].path)
                        .await?
                        .share(options)
                        .await?;
                    Ok(json!([token, key]))
                }
                "free" => region(&c, &held[num(0) as usize].path)
                    .await?
                    .free()
                    .await
                    .map(|()| Value::Null),
                "detach" => region(&c, &held[num(0) as usize].path)
                    .await?
                    .detach()
                    .await
                    .map(|()| Value::Null),
                "info" => Ok(serde_json::to_value(
                    region(&c, &held[num(0) as usize].path)
                        .await?
                        .get_info()
                        .await?,
                )
                .unwrap()),
                "revoke" => region(&c, &held[num(0) as usize].path)
                    .await?
                    .revoke_key(num(1))
                    .await
                    .map(|()| Value::Null),
                "revoke-any" => manager.revoke_key(num(0)).await.map(|()| Value::Null),
                "close" => session_proxy(&c, session.as_deref().unwrap_or_default())
                    .await?
                    .close()
                    .await
                    .map(|()| Value::Null),
                "close-session" => session_proxy(&c, arg(0))
                    .await?
                    .close()
                    .await
                    .map(|()| Value::Null),
                "session-info" => Ok(serde_json::to_value(
                    session_proxy(&c, arg(0)).await?.get_info().await?,
                )
                .unwrap()),
                "region-path" => {
                    // Operate on a region path this client did not get itself.
                    let p = OwnedObjectPath::try_from(arg(0).to_owned())
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    let r = region(&c, &p).await?;
                    match arg(1) {
                        "free" => r.free().await.map(|()| Value::Null),
                        "share" => r.share(Options::new()).await.map(|(t, k)| json!([t, k])),
                        "detach" => r.detach().await.map(|()| Value::Null),
                        "info" => r.get_info().await.map(|i| serde_json::to_value(i).unwrap()),
                        "revoke" => r.revoke_key(num(2)).await.map(|()| Value::Null),
                        other => Err(Error::InvalidArgument(format!(
                            "region-path: unknown {other}"
                        ))),
                    }
                }
                "listen" => {
                    let s = session_proxy(&c, session.as_deref().unwrap_or_default()).await?;
                    let mut options = Options::new();
                    if !arg(2).is_empty() {
                        options.insert("backlog", ZValue::from(num(2) as u32));
                    }
                    if !arg(3).is_empty() {
                        options.insert("private_data", ZValue::from(arg(3).as_bytes().to_vec()));
                    }
                    let port = arg(1).parse::<u16>().unwrap_or(0);
                    s.listen(arg(0), port, options)
                        .await
                        .map(|(id, a, p)| json!([id, a, p]))
                }
                "stop-listening" => {
                    let s = session_proxy(&c, session.as_deref().unwrap_or_default()).await?;
                    s.stop_listening(num(0)).await.map(|()| Value::Null)
                }
                "accept" => {
                    let s = session_proxy(&c, session.as_deref().unwrap_or_default()).await?;
                    let mut options = Options::new();
                    if !arg(1).is_empty() {
                        options.insert("timeout_ms", ZValue::from(num(1) as u32));
                    }
                    let (path, ring, doorbell, completion, info, connection) =
                        s.accept(num(0), options).await?;
                    qps.push(path.to_string());
                    let (fds, ring) = map_ring(ring, doorbell, completion, info)?;
                    ring_fds.push(fds);
                    rings.push(ring);
                    Ok(json!([path.as_str(), connection_json(&connection)]))
                }
                "connect-to" => {
                    let path = if arg(0).starts_with('/') {
                        arg(0).to_owned()
                    } else {
                        qps[num(0) as usize].clone()
                    };
                    let q = qp_proxy(&c, &path).await?;
                    let mut options = Options::new();
                    if !arg(3).is_empty() {
                        options.insert("private_data", ZValue::from(arg(3).as_bytes().to_vec()));
                    }
                    let port = arg(2).parse::<u16>().unwrap_or(0);
                    q.connect_to(arg(1), port, options)
                        .await
                        .map(|d| connection_json(&d))
                }
                "qp" => {
                    let s = session_proxy(&c, session.as_deref().unwrap_or_default()).await?;
                    let mut options = Options::new();
                    if !arg(1).is_empty() {
                        options.insert("send_depth", ZValue::from(num(1) as u32));
                    }
                    if !arg(2).is_empty() {
                        options.insert("recv_depth", ZValue::from(num(2) as u32));
                    }
                    if !arg(3).is_empty() {
                        options.insert("max_inline", ZValue::from(num(3) as u32));
                    }
                    let (path, ring, doorbell, completion, info) =
                        s.create_queue_pair(arg(0), options).await?;
                    qps.push(path.to_string());
                    let (fds, ring) = map_ring(ring, doorbell, completion, info)?;
                    ring_fds.push(fds);
                    rings.push(ring);
                    Ok(json!([
                        path.as_str(),
                        info.size,
                        info.sq_entries,
                        info.cq_entries
                    ]))
                }
                "endpoint" | "qpinfo" | "destroy" | "flush" | "connect" => {
                    // N is an index into this client's QPs, or a path.
                    let path = if arg(0).starts_with('/') {
                        arg(0).to_owned()
                    } else {
                        qps[num(0) as usize].clone()
                    };
                    let q = qp_proxy(&c, &path).await?;
                    match cmd {
                        "endpoint" => Ok(serde_json::to_value(q.endpoint().await?).unwrap()),
                        "qpinfo" => Ok(serde_json::to_value(q.get_info().await?).unwrap()),
                        "destroy" => q.destroy().await.map(|()| Value::Null),
                        "flush" => q.flush().await.map(|()| Value::Null),
                        _ => {
                            let remote: Endpoint = serde_json::from_str(&args[1..].join(" "))
                                .map_err(|e| {
                                    Error::InvalidArgument(format!("endpoint JSON: {e}"))
                                })?;
                            q.connect(&remote, Options::new())
                                .await
                                .map(|()| Value::Null)
                        }
                    }
                }
                "post" => {
                    // post Q OP REGION_IDX|#ID OFFSET LEN WRID [REMOTE_ADDR RKEY [ARG [SWAP]]]
                    let region = if let Some(raw) = arg(2).strip_prefix('#') {
                        raw.parse().unwrap_or(u64::MAX)
                    } else {
                        rdmad_client::names::object_id(held[num(2) as usize].path.as_str())
                            .unwrap_or(0)
                    };
                    let (op, imm) = match arg(1).split_once(':') {
                        Some((op, imm)) => (
                            op,
                            Some(imm.parse::<u32>().map_err(|e| {
                                Error::InvalidArgument(format!("immediate data {imm}: {e}"))
                            })?),
                        ),
                        None => (arg(1), None),
                    };
                    let opcode = match op {
                        "send" => Opcode::Send,
                        "recv" => Opcode::Recv,
                        "write" => Opcode::Write,
                        "read" => Opcode::Read,
                        "fadd" => Opcode::FetchAdd,
                        "cswap" => Opcode::CompareSwap,
                        other => return Err(Error::InvalidArgument(format!("opcode {other}"))),
                    };
                    let sge = RegionSge {
                        region,
                        offset: num(3),
                        length: num(4) as u32,
                    };
                    let sub = Submission {
                        remote_addr: if args.len() > 6 { num(6) } else { 0 },
                        rkey: if args.len() > 7 { num(7) as u32 } else { 0 },
                        compare_add: if args.len() > 8 { num(8) } else { 1 },
                        swap: if args.len() > 9 { num(9) } else { 0 },
                        imm,
                        ..Submission::new(opcode, num(5), sge)
                    };
                    match rings[num(0) as usize]
                        .submit(&sub)
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?
                    {
                        Ok(()) => Ok(Value::Null),
                        Err(_) => Ok(json!("ring full")),
                    }
                }
                "export" => {
                    // export REGION_IDX QP_IDX [ACCESS] → [addr, rkey, len, export id]
                    let qp = zbus::zvariant::ObjectPath::try_from(qps[num(1) as usize].as_str())
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    let mut options = Options::new();
                    if !arg(2).is_empty() {
                        options.insert("access", ZValue::from(arg(2)));
                    }
                    let r = region(&c, &held[num(0) as usize].path).await?;
                    let (addr, rkey, len, export) = r.export_remote(&qp, options).await?;
                    Ok(json!([addr, rkey, len, export]))
                }
                "exports-unanswered" => {
                    // exports-unanswered N REGION_IDX QP_IDX → N: that many
                    // Region.ExportRemote calls sent at once, their replies never awaited.
                    let qp = zbus::zvariant::ObjectPath::try_from(qps[num(2) as usize].as_str())
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    let path = held[num(1) as usize].path.as_str();
                    for _ in 0..num(0) {
                        let mut options = Options::new();
                        options.insert("access", ZValue::from("w"));
                        let call = zbus::message::Message::method_call(path, "ExportRemote")?
                            .destination(rdmad_client::BUS_NAME)?
                            .interface("org.rdmad1.Region")?
                            .build(&(&qp, options))?;
                        c.send(&call).await?;
                    }
                    Ok(json!(num(0)))
                }
                "unexport" => region(&c, &held[num(0) as usize].path)
                    .await?
                    .release_export(num(1))
                    .await
                    .map(|()| Value::Null),
                "post-garbage" => {
                    let mut entry = [0u8; rdmad_client::ring::SQE_SIZE];
                    entry[0] = 0xee;
                    entry[8..16].copy_from_slice(&num(1).to_le_bytes());
                    rings[num(0) as usize]
                        .submit_raw(&entry)
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    Ok(Value::Null)
                }
                "bad-tail" => {
                    // bad-tail Q [N]: the Nth impossible tail in a row (each one
                    // 0x7fff_0000 past the one before, which the daemon skipped to).
                    let n = if arg(1).is_empty() { 1 } else { num(1) as u32 };
                    rings[num(0) as usize]
                        .set_tail_raw(0x7fff_0000u32.wrapping_mul(n))
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    Ok(Value::Null)
                }
                "wait" => {
                    let c = rings[num(0) as usize]
                        .wait(std::time::Duration::from_secs(60))
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    Ok(match c {
                        None => Value::Null,
                        Some(c) => json!({
                            "wr_id": c.wr_id,
                            "status": format!("{:?}", c.status),
                            "opcode": format!("{:?}", c.opcode),
                            "byte_len": c.byte_len,
                            "imm": c.imm,
                            "detail": c.detail,
                        }),
                    })
                }
                "rtt" => {
                    let (qa, qb, count) = (num(0) as usize, num(1) as usize, num(3) as usize);
                    let region =
                        rdmad_client::names::object_id(held[num(2) as usize].path.as_str())
                            .unwrap_or(0);
                    round_trips(&mut rings, qa, qb, region, count)
                }
                "flood" => {
                    // flood Q REGION COUNT LEN REMOTE_ADDR RKEY
                    let region =
                        rdmad_client::names::object_id(held[num(1) as usize].path.as_str())
                            .unwrap_or(0);
                    let count = num(2);
                    let mut queued = 0u64;
                    for i in 0..count {
                        let sub = Submission {
                            remote_addr: num(4),
                            rkey: num(5) as u32,
                            signaled: i + 1 == count,
                            ..Submission::new(
                                Opcode::Write,
                                i,
                                RegionSge {
                                    region,
                                    offset: 0,
                                    length: num(3) as u32,
                                },
                            )
                        };
                        match rings[num(0) as usize].submit(&sub) {
                            Ok(Ok(())) => queued += 1,
                            _ => break,
                        }
                    }
                    Ok(json!(queued))
                }
                "stream" => {
                    // stream Q REGION COUNT LEN REMOTE_ADDR RKEY: COUNT LEN-byte RDMA WRITEs,
                    // each signaled, at most STREAM_IN_FLIGHT in flight (within any send
                    // queue the tests make, so rdmad never refuses one as QueueFull).
                    let region =
                        rdmad_client::names::object_id(held[num(1) as usize].path.as_str())
                            .unwrap_or(0);
                    let (q, count, len) = (num(0) as usize, num(2), num(3) as u32);
                    let started = std::time::Instant::now();
                    let (mut posted, mut completed) = (0u64, 0u64);
                    while completed < count {
                        while posted < count && posted - completed < STREAM_IN_FLIGHT {
                            let sub = Submission {
                                remote_addr: num(4),
                                rkey: num(5) as u32,
                                ..Submission::new(
                                    Opcode::Write,
                                    posted,
                                    RegionSge {
                                        region,
                                        offset: 0,
                                        length: len,
                                    },
                                )
                            };
                            match rings[q]
                                .submit(&sub)
                                .map_err(|e| Error::InvalidArgument(e.to_string()))?
                            {
                                Ok(()) => posted += 1,
                                Err(_) => break,
                            }
                        }
                        let c = rings[q]
                            .wait(std::time::Duration::from_secs(60))
                            .map_err(|e| Error::InvalidArgument(e.to_string()))?
                            .ok_or_else(|| {
                                Error::InvalidArgument(format!(
                                    "no completion within 60 s ({completed} of {count})"
                                ))
                            })?;
                        if c.status != rdmad_client::ring::Status::Success {
                            return Err(Error::InvalidArgument(format!(
                                "write {} failed: {:?}",
                                c.wr_id, c.status
                            )));
                        }
                        completed += 1;
                    }
                    let seconds = started.elapsed().as_secs_f64();
                    Ok(json!({
                        "bytes": count * u64::from(len),
                        "seconds": seconds,
                        "mb_per_s": (count * u64::from(len)) as f64 / seconds / 1e6,
                    }))
                }
                "read-u64" => {
                    let mut buf = [0u8; 8];
                    held[num(0) as usize]
                        .mapping
                        .as_ref()
                        .expect("mapped")
                        .read(num(1) as usize, &mut buf)
                        .expect("read");
                    Ok(json!(u64::from_le_bytes(buf)))
                }
                "write-u64" => {
                    held[num(0) as usize]
                        .mapping
                        .as_ref()
                        .expect("mapped")
                        .write(num(1) as usize, &num(2).to_le_bytes())
                        .expect("write");
                    Ok(Value::Null)
                }
                "rping-adv" => {
                    // rping's `struct rping_rdma_info`: buf, rkey, size, big-endian.
                    let mut info = Vec::with_capacity(16);
                    info.extend_from_slice(&num(2).to_be_bytes());
                    info.extend_from_slice(&(num(3) as u32).to_be_bytes());
                    info.extend_from_slice(&(num(4) as u32).to_be_bytes());
                    held[num(0) as usize]
                        .mapping
                        .as_ref()
                        .expect("mapped")
                        .write(num(1) as usize, &info)
                        .expect("write");
                    Ok(Value::Null)
                }
                "rping-info" => {
                    let mut b = [0u8; 16];
                    held[num(0) as usize]
                        .mapping
                        .as_ref()
                        .expect("mapped")
                        .read(num(1) as usize, &mut b)
                        .expect("read");
                    let word = |r: std::ops::Range<usize>| -> u64 {
                        b[r].iter().fold(0, |v, &x| (v << 8) | u64::from(x))
                    };
                    Ok(json!({"buf": word(0..8), "rkey": word(8..12), "size": word(12..16)}))
                }
                "attack-fds" => Ok(attack_fds(&ring_fds[num(0) as usize])),
                "punch-ring" => Ok(punch_and_truncate(&ring_fds[num(0) as usize].ring)),
                "punch" => Ok(punch_and_truncate(&held[num(0) as usize].fd)),
                "qps" => Ok(serde_json::to_value(manager.list_queue_pairs().await?).unwrap()),
                "devices" => Ok(serde_json::to_value(manager.list_devices().await?).unwrap()),
                "sessions" => Ok(serde_json::to_value(manager.list_sessions().await?).unwrap()),
                "regions" => Ok(serde_json::to_value(manager.list_regions().await?).unwrap()),
                "pools" => Ok(serde_json::to_value(manager.list_pools().await?).unwrap()),
                "quota" => {
                    Ok(serde_json::to_value(manager.get_quota(num(0) as u32).await?).unwrap())
                }
                "reload" => manager.reload().await.map(|()| Value::Null),
                "directs" => {
                    let mut opened = 0;
                    for _ in 0..num(0) {
                        match rdmad_client::connect_direct(&bus).await {
                            Ok(direct) => {
                                directs.push(direct);
                                opened += 1;
                            }
                            Err(e) if opened > 0 => {
                                return Ok(json!({"opened": opened, "then": error_json(e)}))
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    Ok(json!({"opened": opened}))
                }
                "drop-directs" => {
                    directs.clear();
                    Ok(Value::Null)
                }
                "open-direct-on-direct" => {
                    drop(rdmad_client::connect_direct(&c).await?);
                    Ok(Value::Null)
                }
                "whoami" => Ok(json!(bus.unique_name().map(|n| n.to_string()))),
                "forged" => forged_call(&c, arg(0), arg(1)).await,
                "raw-direct" => raw_direct(&manager_on_bus, arg(0)).await,
                "flood-direct" => {
                    let (written, socket) = flood_direct(&manager_on_bus, num(0)).await?;
                    flooded.push(socket);
                    Ok(json!(written))
                }
                "objects" => {
                    let objects = zbus::fdo::ObjectManagerProxy::builder(&c)
                        .destination(rdmad_client::BUS_NAME)?
                        .path(rdmad_client::MANAGER_PATH)?
                        .build()
                        .await?
                        .get_managed_objects()
                        .await?;
                    let mut paths: Vec<String> = objects.keys().map(|p| p.to_string()).collect();
                    paths.sort();
                    Ok(json!(paths))
                }
                "watch" => {
                    let w = DaemonWatch::new(&bus).await?;
                    let owner = w.owner().to_owned();
                    watch = Some(w);
                    Ok(json!(owner))
                }
                "gone" => {
                    let w = watch.as_mut().expect("watch first");
                    match tokio::time::timeout(std::time::Duration::from_secs(60), w.gone()).await {
                        Ok(gone) => Ok(json!({
                            "previous": gone.previous,
                            "current": gone.current,
                            "message": gone.to_string(),
                        })),
                        Err(_) => Err(Error::InvalidArgument("rdmad did not go in 60 s".into())),
                    }
                }
                "exit" => std::process::exit(0),
                other => Err(Error::InvalidArgument(format!("unknown command {other}"))),
            }
        }
        .await;
        let out = match result {
            Ok(v) => json!({"ok": v}),
            Err(e) => error_json(e),
        };
        println!("{out}");
    }
}

/// The next completion on `ring` (60 s at most), as an error if none came.
fn next_completion(ring: &mut QueuePairRing) -> Result<rdmad_client::ring::Completion, Error> {
    ring.wait(std::time::Duration::from_secs(60))
        .map_err(|e| Error::InvalidArgument(e.to_string()))?
        .ok_or_else(|| Error::InvalidArgument("no completion within 60 s".into()))
}

/// `count` 64-byte SEND round trips a → b → a; their latency percentiles in µs.
fn round_trips(
    rings: &mut [QueuePairRing],
    a: usize,
    b: usize,
    region: u64,
    count: usize,
) -> Result<Value, Error> {
    use rdmad_client::ring::Status;
    let sge = |offset| RegionSge {
        region,
        offset,
        length: 64,
    };
    let submit = |ring: &mut QueuePairRing, sub: Submission| {
        ring.submit(&sub)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?
            .map_err(|_| Error::InvalidArgument("ring full".into()))
    };
    // Waits for a receive on `ring`, taking the send completions that come first.
    let receive = |ring: &mut QueuePairRing| loop {
        let c = next_completion(ring)?;
        if c.status != Status::Success {
            return Err(Error::InvalidArgument(format!("completion {c:?}")));
        }
        if c.opcode == Opcode::Recv {
            return Ok(());
        }
    };
    let mut samples = Vec::with_capacity(count);
    for i in 0..count as u64 {
        submit(&mut rings[b], Submission::new(Opcode::Recv, i, sge(1024)))?;
        submit(&mut rings[a], Submission::new(Opcode::Recv, i, sge(2048)))?;
        let start = std::time::Instant::now();
        submit(&mut rings[a], Submission::new(Opcode::Send, i, sge(0)))?;
        receive(&mut rings[b])?;
        submit(&mut rings[b], Submission::new(Opcode::Send, i, sge(0)))?;
        receive(&mut rings[a])?;
        samples.push(start.elapsed().as_secs_f64() * 1e6);
        // The last send completion of b, so the next round starts clean.
        let c = next_completion(&mut rings[b])?;
        if c.status != Status::Success {
            return Err(Error::InvalidArgument(format!("completion {c:?}")));
        }
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    Ok(json!({
        "count": samples.len(),
        "median_us": at(0.5),
        "p99_us": at(0.99),
        "max_us": at(1.0),
    }))
}
