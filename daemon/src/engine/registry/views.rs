//! What a caller may see: snapshots of sessions, regions, queue pairs and quotas.

use std::sync::Arc;
use std::time::SystemTime;

use super::*;

/// A snapshot of a session, as the caller may see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub id: SessionId,
    pub uid: u32,
    pub bus_name: String,
    pub pid: Option<u32>,
    pub created: SystemTime,
    pub regions: Vec<RegionId>,
    pub attachments: Vec<(RegionId, AttachMode)>,
    pub registered_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub id: KeyId,
    pub region: RegionId,
    pub access: AttachMode,
    pub expires: Option<SystemTime>,
    pub owner_uid: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    pub id: RegionId,
    pub session: SessionId,
    pub owner_uid: u32,
    pub pool: String,
    pub device: String,
    pub size: u64,
    pub requested: u64,
    pub keys: Vec<KeyInfo>,
    pub attachments: Vec<(SessionId, AttachMode)>,
}

/// One line of a quota report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaLine {
    pub kind: QuotaKind,
    pub limit: u64,
    pub used: u64,
    pub source: String,
}

impl Registry {
    pub(super) fn session_info(id: SessionId, session: &Session, s: &State) -> SessionInfo {
        SessionInfo {
            id,
            uid: session.owner.uid,
            bus_name: session.owner.bus_name.clone(),
            pid: session.owner.pid,
            created: session.created,
            regions: session.regions.iter().copied().collect(),
            attachments: session.attachments.iter().map(|(r, m)| (*r, *m)).collect(),
            registered_bytes: session
                .regions
                .iter()
                .filter_map(|r| s.regions.get(r))
                .map(Region::size)
                .sum(),
        }
    }

    /// Sessions the caller may see: its user's, or all for an administrator.
    pub fn sessions(&self, config: &Config, caller: &Caller) -> Vec<SessionInfo> {
        let admin = policy::is_admin(caller, config);
        let s = self.lock();
        s.sessions
            .iter()
            .filter(|(_, x)| admin || x.owner.uid == caller.uid)
            .map(|(id, x)| Self::session_info(*id, x, &s))
            .collect()
    }

    pub fn session(
        &self,
        config: &Config,
        caller: &Caller,
        id: SessionId,
    ) -> Result<SessionInfo, EngineError> {
        let admin = policy::is_admin(caller, config);
        let s = self.lock();
        let x = s
            .sessions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("session {id}")))?;
        if x.owner.uid != caller.uid && !admin {
            return Err(not_authorized(format!(
                "session {id} belongs to another user"
            )));
        }
        Ok(Self::session_info(id, x, &s))
    }

    pub(super) fn region_info(id: RegionId, r: &Region, s: &State) -> RegionInfo {
        RegionInfo {
            id,
            session: r.session,
            owner_uid: r.owner_uid,
            pool: r.pool.name().to_owned(),
            device: r.pool.device.clone(),
            size: r.size(),
            requested: r.requested,
            keys: r
                .keys
                .iter()
                .filter_map(|k| s.keys.get(k).map(|key| (k, key)))
                .map(|(k, key)| KeyInfo {
                    id: *k,
                    region: id,
                    access: key.access,
                    expires: key.expires,
                    owner_uid: key.owner_uid,
                })
                .collect(),
            attachments: r.attached.iter().map(|(s, m)| (*s, *m)).collect(),
        }
    }

    pub(super) fn may_see_region(s: &State, r: &Region, caller: &Caller, admin: bool) -> bool {
        admin
            || r.owner_uid == caller.uid
            || r.attached.keys().any(|sid| {
                s.sessions
                    .get(sid)
                    .is_some_and(|x| x.owner.uid == caller.uid)
            })
    }

    /// Regions the caller may see: its user's, those attached by its user, or all for an
    /// administrator.
    pub fn regions(&self, config: &Config, caller: &Caller) -> Vec<RegionInfo> {
        let admin = policy::is_admin(caller, config);
        let s = self.lock();
        s.regions
            .iter()
            .filter(|(_, r)| Self::may_see_region(&s, r, caller, admin))
            .map(|(id, r)| Self::region_info(*id, r, &s))
            .collect()
    }

    pub fn region(
        &self,
        config: &Config,
        caller: &Caller,
        id: RegionId,
    ) -> Result<RegionInfo, EngineError> {
        let admin = policy::is_admin(caller, config);
        let s = self.lock();
        let r = s
            .regions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        if !Self::may_see_region(&s, r, caller, admin) {
            return Err(not_authorized(format!(
                "region {id} belongs to another user"
            )));
        }
        Ok(Self::region_info(id, r, &s))
    }

    /// Queue pairs the caller may see: its user's, or all for an administrator.
    pub fn qps(&self, config: &Config, caller: &Caller) -> Vec<(QpId, Arc<QueuePairRecord>)> {
        let admin = policy::is_admin(caller, config);
        self.lock()
            .qps
            .iter()
            .filter(|(_, q)| admin || q.owner_uid == caller.uid)
            .map(|(id, q)| (*id, Arc::clone(q)))
            .collect()
    }

    /// Limits and live use of `uid`: the caller's own, or anyone's for an administrator.
    pub fn quota(
        &self,
        config: &Config,
        caller: &Caller,
        uid: u32,
    ) -> Result<Vec<QuotaLine>, EngineError> {
        if uid != caller.uid && !policy::is_admin(caller, config) {
            return Err(not_authorized(
                "only administrators may read another user's quota",
            ));
        }
        let gids = if uid == caller.uid {
            caller.gids.clone()
        } else {
            quota::groups_of(uid)
        };
        let limits = quota::limits_for(config, uid, &gids);
        let usage = self.usage(uid);
        Ok(QuotaKind::ALL
            .iter()
            .map(|&kind| QuotaLine {
                kind,
                limit: limits.get(kind).value,
                used: usage.get(kind),
                source: limits.get(kind).source.clone(),
            })
            .collect())
    }
}
