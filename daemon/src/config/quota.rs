//! `[quota.default]`, `[quota.user.NAME]`, `[quota.group.NAME]`: per-user limits.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::size::ByteSize;

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaSection {
    /// Limits of every user without a more specific entry; unset fields take the
    /// built-in defaults.
    #[serde(default)]
    pub default: QuotaLimits,
    /// Per-user limits; unset fields fall back to the user's groups, then to the default.
    #[serde(default)]
    pub user: BTreeMap<String, QuotaLimits>,
    /// Per-group limits; a user in several groups gets the most generous of them.
    #[serde(default)]
    pub group: BTreeMap<String, QuotaLimits>,
}

/// One quota table. Every limit is per user (uid), summed over that user's sessions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaLimits {
    /// Open sessions.
    pub sessions: Option<u64>,
    /// Allocated regions (attached regions are charged to their owner).
    pub regions: Option<u64>,
    /// Bytes of allocated regions.
    pub registered_bytes: Option<ByteSize>,
    /// Live access keys.
    pub keys: Option<u64>,
    /// Queue pairs.
    pub qps: Option<u64>,
    /// Live exports: memory windows bound over regions for peers (`ExportRemote`).
    pub exports: Option<u64>,
    /// Live registrations of regions in sessions' own protection domains
    /// (`Region.Register`: what a verbs program's `ibv_reg_mr` becomes).
    pub registrations: Option<u64>,
}

/// The limits a resource kind has, in the order they are reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuotaKind {
    Sessions,
    Regions,
    RegisteredBytes,
    Keys,
    Qps,
    Exports,
    Registrations,
}

impl QuotaKind {
    pub const ALL: [QuotaKind; 7] = [
        QuotaKind::Sessions,
        QuotaKind::Regions,
        QuotaKind::RegisteredBytes,
        QuotaKind::Keys,
        QuotaKind::Qps,
        QuotaKind::Exports,
        QuotaKind::Registrations,
    ];

    /// The key in a quota table.
    pub fn key(self) -> &'static str {
        match self {
            QuotaKind::Sessions => "sessions",
            QuotaKind::Regions => "regions",
            QuotaKind::RegisteredBytes => "registered_bytes",
            QuotaKind::Keys => "keys",
            QuotaKind::Qps => "qps",
            QuotaKind::Exports => "exports",
            QuotaKind::Registrations => "registrations",
        }
    }

    /// The built-in limit when `[quota.default]` does not set one. Those of shared
    /// resources are small enough that one user at the limit leaves most of the built-in
    /// pool, or of a device's memory windows, to the others (see docs/regions.md, "Sizing
    /// pools and quotas").
    pub fn builtin(self) -> u64 {
        match self {
            QuotaKind::Sessions => 64,
            QuotaKind::Regions => 4096,
            // A quarter of the built-in pool (1 GiB): no one user fills it.
            QuotaKind::RegisteredBytes => 256 << 20,
            QuotaKind::Keys => 4096,
            QuotaKind::Qps => 256,
            // A device's windows (max_mw: 524,287 on rxe and loopback, millions on
            // ConnectX) last for 511 users at this limit.
            QuotaKind::Exports => 1024,
            // Each is a registration on the device (max_mr: 524,287 on rxe and loopback),
            // as each export is a window: the same share.
            QuotaKind::Registrations => 1024,
        }
    }

    /// Above this a limit is a typo, not a policy.
    fn absurd(self) -> u64 {
        match self {
            QuotaKind::RegisteredBytes => 1 << 50,
            _ => 1 << 24,
        }
    }
}

impl QuotaLimits {
    pub fn get(&self, kind: QuotaKind) -> Option<u64> {
        match kind {
            QuotaKind::Sessions => self.sessions,
            QuotaKind::Regions => self.regions,
            QuotaKind::RegisteredBytes => self.registered_bytes.map(|b| b.0),
            QuotaKind::Keys => self.keys,
            QuotaKind::Qps => self.qps,
            QuotaKind::Exports => self.exports,
            QuotaKind::Registrations => self.registrations,
        }
    }

    fn validate(&self, table: &str) -> Result<(), (String, String)> {
        for kind in QuotaKind::ALL {
            if let Some(limit) = self.get(kind) {
                if limit > kind.absurd() {
                    return Err((
                        format!("{table}.{}", kind.key()),
                        format!(
                            "{limit} is absurd (the most rdmad accepts is {})",
                            kind.absurd()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl QuotaSection {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        self.default.validate("quota.default")?;
        for (name, limits) in &self.user {
            let table = format!("quota.user.{}", super::key_segment(name));
            if !super::user_exists(name) {
                return Err((table, format!("there is no user named {name:?}")));
            }
            limits.validate(&table)?;
        }
        for (name, limits) in &self.group {
            let table = format!("quota.group.{}", super::key_segment(name));
            if !super::group_exists(name) {
                return Err((table, format!("there is no group named {name:?}")));
            }
            limits.validate(&table)?;
        }
        Ok(())
    }
}
