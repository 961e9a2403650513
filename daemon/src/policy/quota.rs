//! Quota limits as they apply to one user, and the check made before anything is created.

use crate::config::{Config, QuotaKind};

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

/// The user name of `uid`, or the number when it has none.
pub fn user_name(uid: u32) -> String {
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(user)) => user.name,
        _ => uid.to_string(),
    }
}

/// The groups of `uid` as the system lists them (for callers whose groups the bus did not
/// report, e.g. `GetQuota` of another user).
pub fn groups_of(uid: u32) -> Vec<u32> {
    let Ok(Some(user)) = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) else {
        return Vec::new();
    };
    let Ok(name) = std::ffi::CString::new(user.name) else {
        return Vec::new();
    };
    nix::unistd::getgrouplist(&name, user.gid)
        .map(|gids| gids.into_iter().map(|g| g.as_raw()).collect())
        .unwrap_or_else(|_| vec![user.gid.as_raw()])
}

/// The limits of `uid` with groups `gids`: the user's table, else the most generous of
/// its groups' tables, else `quota.default`, else the built-in default — per key.
pub fn limits_for(config: &Config, uid: u32, gids: &[u32]) -> Limits {
    let user = user_name(uid);
    let user_table = config.quota.user.get(&user);
    let groups: Vec<(&String, &crate::config::QuotaLimits)> = config
        .quota
        .group
        .iter()
        .filter(|(name, _)| super::in_group(name, gids))
        .collect();
    let limits = QuotaKind::ALL
        .iter()
        .map(|&kind| {
            if let Some(v) = user_table.and_then(|t| t.get(kind)) {
                return Limit {
                    value: v,
                    source: format!("quota.user.{user}.{}", kind.key()),
                };
            }
            let best_group = groups
                .iter()
                .filter_map(|(name, t)| t.get(kind).map(|v| (v, *name)))
                .max_by_key(|(v, _)| *v);
            if let Some((v, name)) = best_group {
                return Limit {
                    value: v,
                    source: format!("quota.group.{name}.{}", kind.key()),
                };
            }
            match config.quota.default.get(kind) {
                Some(v) => Limit {
                    value: v,
                    source: format!("quota.default.{}", kind.key()),
                },
                None => Limit {
                    value: kind.builtin(),
                    source: "the built-in default".to_owned(),
                },
            }
        })
        .collect();
    Limits { user, uid, limits }
}

fn describe(kind: QuotaKind) -> &'static str {
    match kind {
        QuotaKind::Sessions => "open sessions",
        QuotaKind::Regions => "regions",
        QuotaKind::RegisteredBytes => "registered bytes",
        QuotaKind::Keys => "access keys",
        QuotaKind::Qps => "queue pairs",
        QuotaKind::Exports => "exports (memory windows)",
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
    use std::path::Path;

    fn config(text: &str) -> Config {
        Config::parse(Path::new("test.toml"), text).unwrap()
    }

    #[test]
    fn user_beats_group_beats_default_beats_builtin() {
        let c = config(
            "[quota.default]\nregions = 10\n[quota.group.root]\nregions = 50\nkeys = 7\n\
             [quota.user.root]\nregions = 20\n",
        );
        let root = limits_for(&c, 0, &[0]);
        assert_eq!(root.get(QuotaKind::Regions).value, 20);
        assert_eq!(
            root.get(QuotaKind::Regions).source,
            "quota.user.root.regions"
        );
        assert_eq!(root.get(QuotaKind::Keys).value, 7);
        assert_eq!(root.get(QuotaKind::Keys).source, "quota.group.root.keys");
        assert_eq!(
            root.get(QuotaKind::Sessions).value,
            QuotaKind::Sessions.builtin()
        );
        let nobody = limits_for(&c, 65534, &[65534]);
        assert_eq!(nobody.get(QuotaKind::Regions).value, 10);
        assert_eq!(
            nobody.get(QuotaKind::Regions).source,
            "quota.default.regions"
        );
    }

    #[test]
    fn refusal_names_limit_use_and_key() {
        let c = config("[quota.default]\nregions = 2\n");
        let limits = limits_for(&c, 65534, &[]);
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
