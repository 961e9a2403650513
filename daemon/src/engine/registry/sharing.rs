//! Access keys: sharing a region, revoking, attaching and detaching.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, SystemTime};

use super::regions::check_pool_access;
use super::*;

impl Registry {
    /// Creates an access key for a region `owner`'s connection owns, within `limits`.
    pub fn share(
        &self,
        owner: &Owner,
        limits: &Limits,
        id: RegionId,
        access: AttachMode,
        lifetime: Option<Duration>,
    ) -> Result<(String, KeyId), EngineError> {
        let (token, digest) = token::new_token()?;
        let expires = match lifetime {
            Some(d) => Some(SystemTime::now().checked_add(d).ok_or_else(|| {
                EngineError::InvalidArgument(format!("expiry {d:?} is too far away"))
            })?),
            None => None,
        };
        let mut s = self.lock();
        Self::own_region(&s, owner, id)?;
        Self::purge_expired(&mut s);
        let usage = s.usage.entry(owner.uid).or_default();
        tenancy::check(limits, usage, QuotaKind::Keys, 1)?;
        usage.add(QuotaKind::Keys, 1);
        s.last_key = s.last_key.next();
        let key_id = s.last_key;
        s.keys.insert(
            key_id,
            Key {
                region: id,
                digest,
                access,
                expires,
                owner_uid: owner.uid,
            },
        );
        s.regions
            .get_mut(&id)
            .expect("checked above")
            .keys
            .insert(key_id);
        Ok((token, key_id))
    }

    /// Revokes a key: its region's owner, or anyone whose scope is everyone's, may. Live
    /// attachments stay.
    pub fn revoke(&self, owner: &Owner, scope: Scope, key: KeyId) -> Result<(), EngineError> {
        let mut s = self.lock();
        let k = s
            .keys
            .get(&key)
            .ok_or(EngineError::NoSuchObject(format!("key {key}")))?;
        let region = k.region;
        if scope != Scope::All {
            Self::own_region(&s, owner, region)?;
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

    /// Attaches the region `token` grants to `session` (`owner`'s), if `pools` admits the
    /// region's pool.
    pub fn attach(
        &self,
        owner: &Owner,
        pools: &PoolAccess,
        session: SessionId,
        token: &str,
    ) -> Result<Handout, EngineError> {
        if !token::well_formed(token) {
            return Err(EngineError::InvalidArgument(format!(
                "not an access key: keys look like {}<64 hex digits>, as Region.Share returns them",
                token::TOKEN_PREFIX
            )));
        }
        let digest = KeyDigest::of(token);
        let mut s = self.lock();
        let (region_id, access) = Self::key_grant(&mut s, owner, session, &digest)?;
        let region = &s.regions[&region_id];
        check_pool_access(&region.pool, pools)?;
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
        .map_err(|e| EngineError::os(format!("cannot hand out region {region_id}"), e))?;
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
        Self::refresh_rights(&s, session);
        Ok(Handout {
            region: region_id,
            fd,
            size,
            access,
        })
    }

    /// The region and access a token's digest grants to `session` (`owner`'s), with
    /// expired keys purged first.
    pub(super) fn key_grant(
        s: &mut State,
        owner: &Owner,
        session: SessionId,
        digest: &KeyDigest,
    ) -> Result<(RegionId, AttachMode), EngineError> {
        Self::own_session(s, owner, session)?;
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

    /// Ends the attachment of a region to a session of `owner`'s connection.
    pub fn detach(&self, owner: &Owner, id: RegionId) -> Result<(), EngineError> {
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
                    .is_some_and(|x| x.owner.connection == owner.connection)
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
        Self::refresh_rights(&s, session);
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
