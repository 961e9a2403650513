//! Slow paths the tests can ask for through the environment, to exercise what the daemon
//! does when the device or its own threads are slow. Read in debug builds only: in release
//! builds (the packages) every hook is a constant no-op.
//!
//! - `RDMAD_TEST_HANDBACK_DELAY_MS=N`: a data-path worker slow to let go of queue pairs.
//!   From the first time a worker is asked to let go of one, for N ms, workers keep serving
//!   every QP they have but let go of none (nor take new ones) — longer than the engine
//!   waits for them (5 s), so that path runs. The daemon logs when the hold starts and
//!   when it ends (`test hook: …`), so a test can wait for either.
//! - `RDMAD_TEST_SLOW_DEVICE_MS=N`: every loopback registration and queue-pair creation
//!   takes N ms more, as on a slow device. The daemon logs when each such operation starts
//!   to wait (`test hook: ibv_reg_mr takes …`) and when it is done (`… done`).
//! - `RDMAD_TEST_SLOW_RELEASE_MS=N`: each release of freed regions takes N ms more (a slow
//!   deregistration), and an allocation refused for want of room waits 2N ms before it
//!   looks at the releases under way — so the release it was refused for ends in between,
//!   the race an allocation right after a `Free` must survive. The daemon logs the wait
//!   (`test hook: a refused allocation waits …`).

#[cfg(debug_assertions)]
use std::sync::OnceLock;
#[cfg(debug_assertions)]
use std::time::Duration;

/// Whether a worker must keep the QPs it is asked to let go of for now; `lets_go` says
/// whether the change at hand lets go of any (asked only when the hook is on).
pub fn hold_handback(lets_go: impl FnOnce() -> bool) -> bool {
    #[cfg(debug_assertions)]
    {
        use std::time::Instant;
        static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
        let Some(delay) = from_env(&DELAY, "RDMAD_TEST_HANDBACK_DELAY_MS") else {
            return false;
        };
        if !lets_go() {
            return false;
        }
        static STARTED: OnceLock<Instant> = OnceLock::new();
        let started = STARTED.get_or_init(|| {
            tracing::warn!("test hook: the data-path workers let go of nothing for {delay:?}");
            Instant::now()
        });
        if started.elapsed() < delay {
            return true;
        }
        static ENDED: std::sync::Once = std::sync::Once::new();
        ENDED.call_once(|| tracing::warn!("test hook: the data-path workers let go again"));
        false
    }
    #[cfg(not(debug_assertions))]
    {
        let _ = lets_go;
        false
    }
}

/// A device operation (`operation`, named as the verb) that takes longer.
pub fn slow_device(operation: &str) {
    #[cfg(debug_assertions)]
    if let Some(delay) = {
        static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
        from_env(&DELAY, "RDMAD_TEST_SLOW_DEVICE_MS")
    } {
        tracing::warn!("test hook: {operation} takes {delay:?}");
        std::thread::sleep(delay);
        tracing::warn!("test hook: {operation} done");
    }
    #[cfg(not(debug_assertions))]
    let _ = operation;
}

/// A release of freed regions that takes longer (see the module documentation).
pub fn slow_release() {
    #[cfg(debug_assertions)]
    if let Some(delay) = release_delay() {
        std::thread::sleep(delay);
    }
}

/// An allocation refused for want of room that looks at the releases under way only after
/// the slow release it was refused for has ended (see the module documentation).
pub fn refused_allocation() {
    #[cfg(debug_assertions)]
    if let Some(delay) = release_delay() {
        tracing::warn!("test hook: a refused allocation waits {:?}", delay * 2);
        std::thread::sleep(delay * 2);
    }
}

#[cfg(debug_assertions)]
fn release_delay() -> Option<Duration> {
    static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
    from_env(&DELAY, "RDMAD_TEST_SLOW_RELEASE_MS")
}

/// A delay in milliseconds from the environment variable `name`, read once into `slot`.
#[cfg(debug_assertions)]
fn from_env(slot: &OnceLock<Option<Duration>>, name: &str) -> Option<Duration> {
    *slot.get_or_init(|| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
    })
}
