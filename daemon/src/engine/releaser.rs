//! Releases behind the reply: `Region.Free` answers once the region is out of the registry
//! (its keys, attachments, rights and windows gone, so nothing can reach it any more) and
//! leaves its deregistration and unmapping to the releaser thread. What the region held of
//! its owner's quota and of its pool ([`Settlement`]) is given back only after that, when
//! the memory is really gone.
//!
//! A registration that a request still in flight holds (a receive posted into the region,
//! say, that no message has come for) is *kept*: the thread lets go of it, and gives back
//! what it holds, only once the request has let go of it too — when it completes, or its
//! QP goes. Until then the region's memory is still there, and so it still counts against
//! its owner's quota and its pool: freeing regions under requests that never complete
//! cannot take a user past its quota.
//!
//! Whoever reads counts, quota or pool use waits first for the releases queued before the
//! read ([`Releaser::settled`]): a client that frees and then looks sees the freed memory
//! gone. An allocation that a quota or a full pool refuses while releases are queued (when
//! it began, or when it was refused: one may end in between) waits for them and tries
//! again, so freeing and then allocating never fails for memory that is on its way out.
//! The thread looks at what it keeps every [`KEPT_LOOK`], when a QP goes
//! ([`Releaser::look_again`]), and once more before a refused allocation gives up — not on
//! every read, so that one registration kept for ever costs other readers nothing.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::registry::{Freed, Registry};
use crate::lock::lock;
use crate::provider::Device;

/// How long a reader waits for queued releases before it reads anyway (and says so).
const SETTLE_WAIT: Duration = Duration::from_secs(30);

/// How often the thread looks at the registrations it keeps for requests in flight, when
/// nothing else makes it look (a release, a reader, a QP's removal).
const KEPT_LOOK: Duration = Duration::from_millis(100);

/// Registrations to drop, each with what it holds of quotas and pools, given back after.
/// An empty one makes the thread look at the registrations it keeps.
#[derive(Default)]
pub(super) struct Deferred {
    pub freed: Vec<Freed>,
}

#[derive(Default)]
struct Queue {
    work: VecDeque<Deferred>,
    /// Releases queued so far, and of those, done: a ticket is done when `done` passed it.
    queued: u64,
    done: u64,
    stop: bool,
    /// Callers of `settled` waiting now.
    waiting: usize,
    /// Registrations the thread keeps because requests in flight still hold them.
    kept: usize,
}

/// The release thread and its queue; dropping it finishes the queue and stops the thread.
pub(super) struct Releaser {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct Shared {
    queue: Mutex<Queue>,
    /// The thread waits on it for work.
    wake: Condvar,
    /// Readers wait on it for `done` to pass their ticket.
    settled: Condvar,
}

impl std::fmt::Debug for Releaser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = lock(&self.shared.queue);
        f.debug_struct("Releaser")
            .field("queued", &q.queued)
            .field("done", &q.done)
            .finish()
    }
}

impl Drop for Releaser {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Releaser {
    /// Starts the release thread, which settles through `registry` and, after every
    /// release, retries what `devices` refused to destroy.
    pub fn spawn(
        registry: Arc<Registry>,
        devices: Vec<Arc<dyn Device>>,
    ) -> std::io::Result<Releaser> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            settled: Condvar::new(),
        });
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("rdmad-release".into())
            .spawn(move || theirs.run(&registry, &devices))?;
        Ok(Releaser {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues `deferred`; returns at once.
    pub fn release(&self, deferred: Deferred) {
        let mut q = lock(&self.shared.queue);
        Self::queue(&mut q, deferred);
        drop(q);
        self.shared.wake.notify_one();
    }

    fn queue(q: &mut Queue, deferred: Deferred) {
        q.work.push_back(deferred);
        q.queued += 1;
    }

    /// Has the thread look at the registrations it keeps, if it keeps any (requests in
    /// flight may have let go of them: a QP was removed).
    pub fn look_again(&self) {
        let mut q = lock(&self.shared.queue);
        if q.kept > 0 {
            Self::queue(&mut q, Deferred::default());
            drop(q);
            self.shared.wake.notify_one();
        }
    }

    /// Whether releases are queued or under way.
    pub fn pending(&self) -> bool {
        let q = lock(&self.shared.queue);
        q.done < q.queued
    }

    /// How many registrations of freed regions requests in flight still hold.
    pub fn kept(&self) -> usize {
        lock(&self.shared.queue).kept
    }

    /// Waits until every release queued before this call is done, and the thread has
    /// looked at the registrations it keeps since (at most [`SETTLE_WAIT`]). Never call it
    /// holding the registry's lock: the releaser settles under it.
    pub fn settled(&self) {
        let deadline = Instant::now() + SETTLE_WAIT;
        let mut q = lock(&self.shared.queue);
        // A release under way may leave a registration kept after this call's ticket: the
        // look after it sees whether it still is.
        if q.kept > 0 || q.done < q.queued {
            Self::queue(&mut q, Deferred::default());
            self.shared.wake.notify_one();
        }
        let ticket = q.queued;
        q.waiting += 1;
        while q.done < ticket && !q.stop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    queued = q.queued - q.done,
                    "releases of freed regions are taking over {SETTLE_WAIT:?}: reading counts \
                     that still include them"
                );
                break;
            }
            q = self
                .shared
                .settled
                .wait_timeout(q, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        q.waiting -= 1;
    }

    /// How many callers wait in [`Releaser::settled`] now.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        lock(&self.shared.queue).waiting
    }

    /// Finishes what is queued and stops the thread (once; later calls do nothing).
    pub fn stop(&self) {
        lock(&self.shared.queue).stop = true;
        self.shared.wake.notify_all();
        if let Some(thread) = lock(&self.thread).take() {
            if thread.join().is_err() {
                tracing::error!("the release thread panicked");
            }
        }
        self.shared.settled.notify_all();
    }
}

/// What the thread does next.
enum Next {
    /// A queued release (a ticket).
    Release(Deferred),
    /// A look at the kept registrations, on the thread's own time.
    Look,
    Stop,
}

impl Shared {
    fn run(&self, registry: &Registry, devices: &[Arc<dyn Device>]) {
        let mut kept: Vec<Freed> = Vec::new();
        loop {
            let next = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(d) = q.work.pop_front() {
                        break Next::Release(d);
                    }
                    if q.stop {
                        break Next::Stop;
                    }
                    if kept.is_empty() {
                        q = self
                            .wake
                            .wait(q)
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        continue;
                    }
                    let (again, waited) = self
                        .wake
                        .wait_timeout(q, KEPT_LOOK)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    q = again;
                    if waited.timed_out() && q.work.is_empty() {
                        break Next::Look;
                    }
                }
            };
            let ticket = match next {
                Next::Release(Deferred { freed }) => {
                    for f in &freed {
                        if !f.unpinned() {
                            tracing::debug!(
                                "a freed region's memory is held by a request in flight: \
                                 kept, and counted, until the request lets go of it"
                            );
                        }
                    }
                    kept.extend(freed);
                    true
                }
                Next::Look => false,
                // What requests still hold goes when they let go of it.
                Next::Stop => return,
            };
            let before = kept.len();
            let (settlements, still) = Freed::let_go(std::mem::take(&mut kept));
            kept = still;
            if kept.len() < before {
                crate::test_hooks::slow_release();
                for device in devices {
                    device.retry_lingering();
                }
            }
            registry.settle(settlements);
            let mut q = lock(&self.queue);
            q.kept = kept.len();
            if ticket {
                q.done += 1;
            }
            drop(q);
            self.settled.notify_all();
        }
    }
}

/// A registration whose deregistration (its drop) takes until the test says so: it holds
/// the release thread, as a slow device would.
#[cfg(test)]
pub(super) mod testing {
    use std::any::Any;
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};

    use crate::lock::lock;
    use crate::memory::SharedMemory;
    use crate::provider::{Access, MemoryRegion};

    #[derive(Debug)]
    struct SlowMr {
        memory: Arc<SharedMemory>,
        go: Mutex<mpsc::Receiver<()>>,
        dropped: mpsc::Sender<()>,
    }

    impl MemoryRegion for SlowMr {
        fn lkey(&self) -> u32 {
            1
        }
        fn rkey(&self) -> u32 {
            1
        }
        fn access(&self) -> Access {
            Access::default()
        }
        fn memory(&self) -> &Arc<SharedMemory> {
            &self.memory
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    impl Drop for SlowMr {
        fn drop(&mut self) {
            let _ = lock(&self.go).recv();
            let _ = self.dropped.send(());
        }
    }

    /// The registration, the sender that lets its drop finish, and the receiver that hears
    /// it finished.
    pub fn slow_mr() -> (Arc<dyn MemoryRegion>, mpsc::Sender<()>, mpsc::Receiver<()>) {
        let (go_tx, go_rx) = mpsc::channel();
        let (dropped_tx, dropped_rx) = mpsc::channel();
        let memory = SharedMemory::create(c"slow", 4096).unwrap();
        let mr = Arc::new(SlowMr {
            memory: Arc::new(memory),
            go: Mutex::new(go_rx),
            dropped: dropped_tx,
        });
        (mr, go_tx, dropped_rx)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::slow_mr;
    use super::*;

    /// `release` returns while the deregistration is still under way; `settled` returns
    /// only after it; a release queued after a `settled` began is not waited for.
    #[test]
    fn release_returns_before_the_deregistration_and_settled_waits_for_it() {
        let releaser = Releaser::spawn(Arc::new(Registry::default()), Vec::new()).unwrap();
        let (mr, go, dropped) = slow_mr();
        releaser.release(Deferred {
            freed: vec![Freed {
                mr,
                domain_registrations: Vec::new(),
                settlement: None,
            }],
        });
        assert!(releaser.pending(), "the deregistration is held back");
        assert!(dropped.try_recv().is_err());

        let releaser = &releaser;
        std::thread::scope(|s| {
            let waiter = s.spawn(move || {
                releaser.settled();
                dropped.try_recv().is_ok()
            });
            go.send(()).unwrap();
            assert!(waiter.join().unwrap(), "settled returned before the drop");
        });
        assert!(!releaser.pending());
        releaser.stop();
    }

    /// Stopping finishes what is queued: nothing freed is left registered.
    #[test]
    fn stop_finishes_the_queue() {
        let releaser = Releaser::spawn(Arc::new(Registry::default()), Vec::new()).unwrap();
        let (mr, go, dropped) = slow_mr();
        releaser.release(Deferred {
            freed: vec![Freed {
                mr,
                domain_registrations: Vec::new(),
                settlement: None,
            }],
        });
        go.send(()).unwrap();
        releaser.stop();
        assert!(dropped.try_recv().is_ok());
        assert!(!releaser.pending());
    }
}
