//! User and group lookups go through NSS (files, LDAP, sssd, …) and take as long as the
//! directory behind it takes to answer. None may run while the registry's lock is held,
//! or one slow lookup would stall every tenant's calls. Debug builds check it: the registry
//! marks the thread while it holds its lock ([`forbid`]), and every lookup asserts the mark
//! is absent ([`check`]).

use std::cell::Cell;

thread_local! {
    static FORBIDDEN: Cell<u32> = const { Cell::new(0) };
}

/// Forbids lookups on this thread until the returned guard is dropped.
pub fn forbid() -> Forbidden {
    FORBIDDEN.with(|f| f.set(f.get() + 1));
    Forbidden(())
}

/// While it lives, lookups on this thread are a bug (see [`forbid`]).
#[derive(Debug)]
pub struct Forbidden(());

impl Drop for Forbidden {
    fn drop(&mut self) {
        FORBIDDEN.with(|f| f.set(f.get().saturating_sub(1)));
    }
}

/// Called by every user or group lookup: in debug builds, fails if the registry's lock is
/// held on this thread.
pub fn check(what: &str) {
    debug_assert!(
        FORBIDDEN.with(Cell::get) == 0,
        "{what}: a user or group lookup while the registry's lock is held"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_are_allowed_again_once_the_guard_is_gone() {
        let outer = forbid();
        let inner = forbid();
        drop(inner);
        assert_eq!(FORBIDDEN.with(Cell::get), 1);
        drop(outer);
        check("after the lock");
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "a user or group lookup while the registry's lock is held")]
    fn a_lookup_under_the_registry_lock_fails_in_debug_builds() {
        let _held = forbid();
        crate::policy::quota::user_name(0);
    }
}
