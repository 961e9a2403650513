//! Lock helpers. A daemon holding other processes' resources must not die because some
//! thread panicked while holding a lock: the data behind it stays consistent because every
//! critical section here either completes or leaves the map untouched.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, recovering the guard if a previous holder panicked.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
