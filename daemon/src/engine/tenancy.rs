//! What the engine is told about whoever asks: plain decisions the policy layer made from
//! the caller and the configuration. The engine never sees a bus caller or reads who may do
//! what; it checks use against the [`Limits`] it is given and charges it under its own
//! lock, so concurrent requests never overshoot.

use std::collections::BTreeMap;

use crate::config::QuotaKind;

/// Who owns what is made: the user, and the bus connection whose sessions hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    /// The unique bus name (`:1.42`): only this connection uses the objects it made.
    pub connection: String,
    pub pid: Option<u32>,
}

/// Whose objects a caller may see, close and revoke beyond its connection's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Its user's.
    Own,
    /// Everyone's (administrators).
    All,
}

/// The pools a caller may allocate from and attach regions of: every pool but those
/// listed, each with the reason it is refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolAccess {
    refused: BTreeMap<String, String>,
}

impl PoolAccess {
    /// Every pool.
    pub fn everywhere() -> PoolAccess {
        PoolAccess::default()
    }

    /// Refuses pool `pool`, saying why.
    pub fn refuse(&mut self, pool: &str, reason: String) {
        self.refused.insert(pool.to_owned(), reason);
    }

    /// Why pool `pool` is refused, if it is.
    pub fn refusal(&self, pool: &str) -> Option<&str> {
        self.refused.get(pool).map(String::as_str)
    }
}

/// One limit and the configuration key it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    pub value: u64,
    /// e.g. `quota.group.rdma.regions`, or `built-in default` when nothing set it.
    pub source: String,
}

/// The limits of one user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    pub user: String,
    pub uid: u32,
    limits: Vec<Limit>,
}

impl Limits {
    /// The limits of user `user` (uid `uid`): one per [`QuotaKind`], in the order of
    /// [`QuotaKind::ALL`].
    pub fn new(user: String, uid: u32, limits: Vec<Limit>) -> Limits {
        assert_eq!(
            limits.len(),
            QuotaKind::ALL.len(),
            "one limit per quota kind"
        );
        Limits { user, uid, limits }
    }

    /// No limit on anything (for tests of what quotas do not decide).
    #[cfg(test)]
    pub fn unlimited(uid: u32) -> Limits {
        let limits = QuotaKind::ALL
            .iter()
            .map(|_| Limit {
                value: u64::MAX,
                source: "the test".to_owned(),
            })
            .collect();
        Limits::new(uid.to_string(), uid, limits)
    }

    pub fn get(&self, kind: QuotaKind) -> &Limit {
        &self.limits[kind as usize]
    }
}

/// Live use of one user.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    counts: [u64; QuotaKind::ALL.len()],
}

impl Usage {
    pub fn get(&self, kind: QuotaKind) -> u64 {
        self.counts[kind as usize]
    }

    pub fn add(&mut self, kind: QuotaKind, amount: u64) {
        self.counts[kind as usize] += amount;
    }

    pub fn sub(&mut self, kind: QuotaKind, amount: u64) {
        let c = &mut self.counts[kind as usize];
        debug_assert!(*c >= amount, "{kind:?} usage would go negative");
        *c = c.saturating_sub(amount);
    }

    pub fn is_zero(&self) -> bool {
        self.counts.iter().all(|&c| c == 0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "quota exceeded: {what} of user {user} (uid {uid}): {used} in use, {requested} more requested, \
     limit {limit} (set by {set_by}); raise quota.user.{user}.{key} to allow more"
)]
pub struct QuotaError {
    pub kind: QuotaKind,
    pub what: &'static str,
    pub user: String,
    pub uid: u32,
    pub used: u64,
    pub requested: u64,
    pub limit: u64,
    pub set_by: String,
    pub key: &'static str,
}

fn describe(kind: QuotaKind) -> &'static str {
    match kind {
        QuotaKind::Sessions => "open sessions",
        QuotaKind::Regions => "regions",
        QuotaKind::RegisteredBytes => "registered bytes",
        QuotaKind::Keys => "access keys",
        QuotaKind::Qps => "queue pairs",
        QuotaKind::Exports => "exports (memory windows)",
        QuotaKind::Registrations => "registrations in protection domains of its own",
    }
}

/// Fails unless `requested` more of `kind` fit in `limits` on top of `usage`.
pub fn check(
    limits: &Limits,
    usage: &Usage,
    kind: QuotaKind,
    requested: u64,
) -> Result<(), QuotaError> {
    let limit = limits.get(kind);
    let used = usage.get(kind);
    if used
        .checked_add(requested)
        .is_some_and(|total| total <= limit.value)
    {
        return Ok(());
    }
    Err(QuotaError {
        kind,
        what: describe(kind),
        user: limits.user.clone(),
        uid: limits.uid,
        used,
        requested,
        limit: limit.value,
        set_by: limit.source.clone(),
        key: kind.key(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_names_limit_use_and_key() {
        let limits = Limits::new(
            "nobody".to_owned(),
            65534,
            QuotaKind::ALL
                .iter()
                .map(|&kind| Limit {
                    value: if kind == QuotaKind::Regions { 2 } else { 100 },
                    source: format!("quota.default.{}", kind.key()),
                })
                .collect(),
        );
        let mut usage = Usage::default();
        usage.add(QuotaKind::Regions, 2);
        let err = check(&limits, &usage, QuotaKind::Regions, 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            "quota exceeded: regions of user nobody (uid 65534): 2 in use, 1 more requested, \
             limit 2 (set by quota.default.regions); raise quota.user.nobody.regions to allow more"
        );
        usage.sub(QuotaKind::Regions, 1);
        check(&limits, &usage, QuotaKind::Regions, 1).unwrap();
        assert!(check(&limits, &usage, QuotaKind::Regions, u64::MAX).is_err());
    }
}
