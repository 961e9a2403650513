//! Lock helpers. A daemon holding other processes' resources must not die because some
//! thread panicked while holding a lock: the data behind it stays consistent because every
//! critical section here either completes or leaves the map untouched. And no user or group
//! lookup may run while the registry's lock is held, nor on a thread that serves the bus
//! (checked in debug builds).

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, recovering the guard if a previous holder panicked.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// User and group lookups under a lock.
//
// User and group lookups go through NSS (files, LDAP, sssd, …) and take as long as the
// directory behind it takes to answer. None may run while the registry's lock is held,
// nor on one of the two threads that serve the bus (they run every client's calls), or one
// slow lookup would stall every tenant's calls. Debug builds check it: the registry marks
// the thread while it holds its lock ([`forbid_lookups`]), the runtime marks its executor
// threads ([`mark_executor`]), and every lookup asserts neither mark is there
// ([`check_lookup`]).

thread_local! {
    static FORBIDDEN: Cell<u32> = const { Cell::new(0) };
    static EXECUTOR: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as one that serves the bus (the async runtime's executor threads: it
/// calls this each time one goes idle), where no lookup may run.
pub fn mark_executor() {
    EXECUTOR.with(|e| e.set(true));
}

/// Forbids lookups on this thread until the returned guard is dropped.
pub fn forbid_lookups() -> Forbidden {
    FORBIDDEN.with(|f| f.set(f.get() + 1));
    Forbidden(())
}

/// While it lives, lookups on this thread are a bug (see [`forbid_lookups`]).
#[derive(Debug)]
pub struct Forbidden(());

impl Drop for Forbidden {
    fn drop(&mut self) {
        FORBIDDEN.with(|f| f.set(f.get().saturating_sub(1)));
    }
}

/// Called by every user or group lookup: in debug builds, fails if the registry's lock is
/// held on this thread, or the thread serves the bus.
pub fn check_lookup(what: &str) {
    debug_assert!(
        FORBIDDEN.with(Cell::get) == 0,
        "{what}: a user or group lookup while the registry's lock is held"
    );
    debug_assert!(
        !EXECUTOR.with(Cell::get),
        "{what}: a user or group lookup on a thread that serves the bus (use a blocking \
         thread, or the caller's cached grants)"
    );
}

#[cfg(test)]
mod lookup_tests {
    use super::*;

    #[test]
    fn lookups_are_allowed_again_once_the_guard_is_gone() {
        let outer = forbid_lookups();
        let inner = forbid_lookups();
        drop(inner);
        assert_eq!(FORBIDDEN.with(Cell::get), 1);
        drop(outer);
        check_lookup("after the lock");
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "a user or group lookup while the registry's lock is held")]
    fn a_lookup_under_the_registry_lock_fails_in_debug_builds() {
        let _held = forbid_lookups();
        crate::policy::quota::user_name(0);
    }

    /// A lookup in a task on a runtime's executor (marked as the daemon's runtime marks
    /// it) fails; one in its blocking closure does not.
    #[cfg(debug_assertions)]
    #[test]
    fn a_lookup_on_a_thread_that_serves_the_bus_fails_in_debug_builds() {
        let (parked, went_idle) = std::sync::mpsc::sync_channel(1);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .on_thread_park(move || {
                mark_executor();
                let _ = parked.try_send(());
            })
            .build()
            .unwrap();
        // The one worker went idle once, so it is marked.
        went_idle.recv().unwrap();
        runtime.block_on(async {
            let on_executor = tokio::spawn(async { crate::policy::quota::user_name(0) }).await;
            let panic = on_executor
                .expect_err("a lookup on the executor")
                .into_panic();
            let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(
                message.contains("a user or group lookup on a thread that serves the bus"),
                "{message}"
            );
            let off = tokio::task::spawn_blocking(|| crate::policy::quota::user_name(0)).await;
            assert_eq!(off.unwrap(), "root");
        });
    }
}
