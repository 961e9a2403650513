//! Wake-ups between the worker and a client: one pipe per direction, the daemon keeping one
//! end and lending the client the other.
//!
//! Why pipes and not one eventfd both sides hold: a descriptor passed over D-Bus shares
//! its *open file description* with the sender, flags included. A client that clears
//! `O_NONBLOCK` on a shared eventfd makes the daemon's next read of an empty counter block
//! for ever, and one that fills the counter to `u64::MAX - 1` blocks the daemon's next
//! write — either stops the worker and every other tenant's queue pairs with it. A pipe's
//! two ends are two open file descriptions: the client can change its own end's flags,
//! fill the pipe, close or dup its end, and the daemon's end stays non-blocking; the daemon's
//! reads and writes are bounded and never wait. (Reopening an end through `/proc/self/fd`
//! is refused to other users — the pipes are the daemon's, mode 0600 — and gives root only
//! an open file description of its own.) The daemon keeps its copy of the client's ends
//! too: so a client closing its end never makes the daemon's end hang up (an epoll that
//! returns at once for ever, or `EPIPE`).
//! (A socket pair would also have separate ends, but a client could pass descriptors
//! through it, and the daemon closing them on receipt could be made to wait.)

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::OFlag;

/// One direction of wake-ups: the daemon's end and the end lent to the client.
#[derive(Debug)]
pub struct WakePipe {
    daemon: OwnedFd,
    client: OwnedFd,
}

/// The most a drain reads at once: a client writing its doorbell without pause cannot keep
/// the worker reading it.
const DRAIN_BYTES: usize = 4096;

impl WakePipe {
    fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
        Ok(nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)?)
    }

    /// A doorbell: the client writes, the daemon reads.
    pub fn doorbell() -> io::Result<WakePipe> {
        let (read, write) = Self::pipe()?;
        Ok(WakePipe {
            daemon: read,
            client: write,
        })
    }

    /// A completion channel: the daemon writes, the client reads (and polls).
    pub fn completions() -> io::Result<WakePipe> {
        let (read, write) = Self::pipe()?;
        Ok(WakePipe {
            daemon: write,
            client: read,
        })
    }

    /// The daemon's end, to poll.
    pub fn daemon_end(&self) -> BorrowedFd<'_> {
        self.daemon.as_fd()
    }

    /// The client's end, to duplicate and pass to the client.
    pub fn client_end(&self) -> BorrowedFd<'_> {
        self.client.as_fd()
    }

    /// Wakes the client. A full pipe already holds a wake-up the client has not read.
    pub fn signal(&self) {
        match nix::unistd::write(&self.daemon, &[1]) {
            Ok(_) | Err(Errno::EAGAIN) => {}
            Err(e) => tracing::debug!("completion wake-up: {e}"),
        }
    }

    /// Empties the daemon's end as far as one bounded read goes.
    pub fn drain(&self) {
        let mut buf = [0u8; DRAIN_BYTES];
        let _ = nix::unistd::read(self.daemon.as_raw_fd(), &mut buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_blocking(fd: BorrowedFd<'_>) {
        nix::fcntl::fcntl(
            fd.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETFL(OFlag::empty()),
        )
        .unwrap();
    }

    /// Whatever a client does to its end — blocking mode, a full pipe, a reopened copy —
    /// the daemon's reads and writes return at once.
    #[test]
    fn the_clients_end_cannot_make_the_daemon_wait() {
        let doorbell = WakePipe::doorbell().unwrap();
        let completions = WakePipe::completions().unwrap();
        set_blocking(doorbell.client_end());
        set_blocking(completions.client_end());
        // A reopened end is a new open file description with the client's own flags:
        // fill the completion pipe through one.
        let path = format!("/proc/self/fd/{}", completions.client_end().as_raw_fd());
        let reopened = std::os::unix::fs::OpenOptionsExt::custom_flags(
            std::fs::OpenOptions::new().write(true),
            libc::O_NONBLOCK,
        )
        .open(path)
        .unwrap();
        let filler = [0u8; 4096];
        loop {
            match nix::unistd::write(&reopened, &filler) {
                Ok(_) => {}
                Err(Errno::EAGAIN) => break,
                Err(e) => panic!("{e}"),
            }
        }
        let start = std::time::Instant::now();
        for _ in 0..1000 {
            completions.signal();
            doorbell.drain();
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }
}
