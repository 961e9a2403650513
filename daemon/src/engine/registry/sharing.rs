//! Access keys: sharing a region, revoking, attaching and detaching.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::regions::check_pool_access;
use super::*;

impl Registry {
    /// Creates an access key for a region the caller owns.
    pub fn share(
        &self,
        config: &Config,
        caller: &Caller,
        id: RegionId,
        access: AttachMode,
        lifetime: Option<Duration>,
    ) -> Result<(String, KeyId), EngineError> {
        let limits = quota::limits_for(config, caller.uid, &caller.gids);
        let (token, digest) =
            keys::new_token().map_err(|e| EngineError::Io(format!("no random numbers: {e}")))?;
        let expires = match lifetime {
            Some(d) => Some(SystemTime::now().checked_add(d).ok_or_else(|| {
                EngineError::InvalidArgument(format!("expiry {d:?} is too far away"))
            })?),
            None => None,
        };
        let mut s = self.lock();
        Self::own_region(&s, caller, id)?;
        Self::purge_expired(&mut s);
        let usage = s.usage.entry(caller.uid).or_default();
        quota::check(&limits, usage, QuotaKind::Keys, 1)?;
        usage.add(QuotaKind::Keys, 1);
        s.last_key += 1;
        let key_id = s.last_key;
        s.keys.insert(
            key_id,
            Key {
                region: id,
                digest,
                access,
                expires,
                owner_uid: caller.uid,
            },
        );
        s.regions
            .get_mut(&id)
            .expect("checked above")
            .keys
            .insert(key_id);
        Ok((token, key_id))
    }

    /// Revokes a key: its region's owner or an administrator may. Live attachments stay.
    pub fn revoke(&self, config: &Config, caller: &Caller, key: KeyId) -> Result<(), EngineError> {
        let admin = policy::is_admin(caller, config);
        let mut s = self.lock();
        let k = s
            .keys
            .get(&key)
            .ok_or(EngineError::NoSuchObject(format!("key {key}")))?;
        let region = k.region;
        if !admin {
            Self::own_region(&s, caller, region)?;
        }
        Self::remove_key(&mut s, key);
        Ok(())
    }

    pub(super) fn remove_key(s: &mut State, key: KeyId) {
        if let Some(k) = s.keys.remove(&key) {
            if let Some(r) = s.regions.get_mut(&k.region) {
                r.keys.remove(&key);
            }
            if let Some(usage) = s.usage.get_mut(&k.owner_uid) {
                usage.sub(QuotaKind::Keys, 1);
            }
            Self::forget_idle_user(s, k.owner_uid);
        }
    }

    pub(super) fn purge_expired(s: &mut State) {
        let now = SystemTime::now();
        let expired: Vec<KeyId> = s
            .keys
            .iter()
            .filter(|(_, k)| k.expires.is_some_and(|e| e <= now))
            .map(|(id, _)| *id)
            .collect();
        for key in expired {
            Self::remove_key(s, key);
        }
    }

    /// Attaches the region `token` grants to `session`.
    pub fn attach(
        &self,
        caller: &Caller,
        session: SessionId,
        token: &str,
    ) -> Result<Handout, EngineError> {
        if !keys::well_formed(token) {
            return Err(EngineError::InvalidArgument(format!(
                "not an access key: keys look like {}<64 hex digits>, as Region.Share returns them",
                keys::TOKEN_PREFIX
            )));
        }
        let digest = KeyDigest::of(token);
        // The pool's access list may need the caller's user and groups looked up: that is
        // done with the lock released, and the key looked up again afterwards.
        let pool = {
            let mut s = self.lock();
            let (region, _) = Self::key_grant(&mut s, caller, session, &digest)?;
            Arc::clone(&s.regions[&region].pool)
        };
        check_pool_access(&pool, caller)?;
        let mut s = self.lock();
        let (region_id, access) = Self::key_grant(&mut s, caller, session, &digest)?;
        // A key always grants the same region, so the pool checked above is this one's.
        let region = &s.regions[&region_id];
        if region.session == session {
            return Err(EngineError::InvalidArgument(format!(
                "region {region_id} belongs to this session already"
            )));
        }
        if region.attached.contains_key(&session) {
            return Err(EngineError::InvalidArgument(format!(
                "region {region_id} is attached to this session already"
            )));
        }
        let fd = match access {
            AttachMode::ReadWrite => region.mr.memory().fd().try_clone_to_owned(),
            AttachMode::ReadOnly => reopen_read_only(region.mr.memory().fd()),
        }
        .map_err(|e| EngineError::Io(format!("cannot hand out region {region_id}: {e}")))?;
        let size = region.size();
        s.regions
            .get_mut(&region_id)
            .expect("looked up above")
            .attached
            .insert(session, access);
        s.sessions
            .get_mut(&session)
            .expect("checked above")
            .attachments
            .insert(region_id, access);
        Ok(Handout {
            region: region_id,
            fd,
            size,
            access,
        })
    }

    /// The region and access a token's digest grants to `session` (the caller's own), with
    /// expired keys purged first.
    pub(super) fn key_grant(
        s: &mut State,
        caller: &Caller,
        session: SessionId,
        digest: &KeyDigest,
    ) -> Result<(RegionId, AttachMode), EngineError> {
        Self::own_session(s, caller, session)?;
        Self::purge_expired(s);
        let invalid = || {
            not_authorized(
                "the access key is not valid (unknown, revoked, expired, or its region was freed)",
            )
        };
        let (region, access) = s
            .keys
            .values()
            .find(|k| k.digest.matches(digest))
            .map(|k| (k.region, k.access))
            .ok_or_else(invalid)?;
        if !s.regions.contains_key(&region) {
            return Err(invalid());
        }
        Ok((region, access))
    }

    /// Ends the caller's attachment of a region.
    pub fn detach(&self, caller: &Caller, id: RegionId) -> Result<(), EngineError> {
        let mut s = self.lock();
        let region = s
            .regions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        let session = region
            .attached
            .keys()
            .copied()
            .find(|sid| {
                s.sessions
                    .get(sid)
                    .is_some_and(|x| x.owner.bus_name == caller.bus_name)
            })
            .ok_or_else(|| {
                not_authorized(format!("region {id} is not attached to your session"))
            })?;
        s.regions
            .get_mut(&id)
            .expect("looked up")
            .attached
            .remove(&session);
        if let Some(x) = s.sessions.get_mut(&session) {
            x.attachments.remove(&id);
        }
        Ok(())
    }
}

/// A new read-only open file description of the memfd: the kernel then refuses writable
/// shared mappings and writes through it.
fn reopen_read_only(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    let file = std::fs::OpenOptions::new().read(true).open(path)?;
    Ok(file.into())
}
