//! Access keys: capability tokens that let another local process attach a region.
//! A token carries 256 bits from the OS random generator; the daemon keeps only its
//! SHA-256 digest and compares digests in constant time.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Prefix that makes a token recognizable in logs and scripts (the secret follows).
pub const TOKEN_PREFIX: &str = "rdk1_";

/// The digest the daemon stores instead of the token.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyDigest([u8; 32]);

impl std::fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print even the digest in full.
        write!(f, "KeyDigest({:02x}{:02x}…)", self.0[0], self.0[1])
    }
}

impl KeyDigest {
    pub fn of(token: &str) -> KeyDigest {
        KeyDigest(Sha256::digest(token.as_bytes()).into())
    }

    /// Constant-time comparison.
    pub fn matches(&self, other: &KeyDigest) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

/// A fresh token and its digest.
pub fn new_token() -> Result<(String, KeyDigest), getrandom::Error> {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret)?;
    let mut token = String::with_capacity(TOKEN_PREFIX.len() + 64);
    token.push_str(TOKEN_PREFIX);
    for b in secret {
        token.push_str(&format!("{b:02x}"));
    }
    let digest = KeyDigest::of(&token);
    Ok((token, digest))
}

/// Whether `token` has the shape of a token (checked before hashing, so garbage is
/// refused with a clear message).
pub fn well_formed(token: &str) -> bool {
    token
        .strip_prefix(TOKEN_PREFIX)
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_unique_well_formed_and_match_only_their_digest() {
        let (a, da) = new_token().unwrap();
        let (b, db) = new_token().unwrap();
        assert_ne!(a, b);
        assert!(well_formed(&a) && well_formed(&b));
        assert!(KeyDigest::of(&a).matches(&da));
        assert!(!KeyDigest::of(&a).matches(&db));
        assert!(!format!("{da:?}").contains(&a[TOKEN_PREFIX.len()..]));
    }

    #[test]
    fn malformed_tokens_are_recognized() {
        for t in [
            "",
            "rdk1_",
            "rdk1_xyz",
            &format!("rdk2_{}", "0".repeat(64)),
            &"0".repeat(69),
        ] {
            assert!(!well_formed(t), "{t}");
        }
    }
}
