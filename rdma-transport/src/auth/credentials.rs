//! Coordinator credentials derived from the cluster key, so that nothing
//! but the key has to be distributed.
//!
//! Each is the lower-case hex of `HMAC-SHA256(key, label)`:
//!
//! | credential | label                                  | may                              |
//! |------------|----------------------------------------|----------------------------------|
//! | node `id`  | `"pgtp node credential\0"` then `id`   | read; change node `id` only      |
//! | client     | `"pgtp client credential\0"`           | read                             |
//! | admin      | `"pgtp admin credential\0"`            | everything                       |
//!
//! The same value can be made without this crate, e.g. for the admin one:
//! `printf 'pgtp admin credential\0' | openssl dgst -sha256 -mac HMAC
//! -macopt hexkey:$(cat cluster.key) | sed 's/.*= //'`.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::ClusterKey;

/// HMAC label of a node credential; the node id follows it.
pub const NODE_CREDENTIAL_LABEL: &[u8] = b"pgtp node credential\0";
/// HMAC label of the read-only client credential.
pub const CLIENT_CREDENTIAL_LABEL: &[u8] = b"pgtp client credential\0";
/// HMAC label of the admin (operator) credential.
pub const ADMIN_CREDENTIAL_LABEL: &[u8] = b"pgtp admin credential\0";

impl ClusterKey {
    /// The credential of node `node_id`: lets it register, heartbeat and
    /// publish itself and claim or remove its own ranges, and read.
    pub fn node_credential(&self, node_id: &str) -> String {
        self.credential(&[NODE_CREDENTIAL_LABEL, node_id.as_bytes()])
    }

    /// The client credential: reads only (what a `TransportManager` needs).
    pub fn client_credential(&self) -> String {
        self.credential(&[CLIENT_CREDENTIAL_LABEL])
    }

    /// The admin credential: every route (operators and their tools).
    pub fn admin_credential(&self) -> String {
        self.credential(&[ADMIN_CREDENTIAL_LABEL])
    }

    fn credential(&self, parts: &[&[u8]]) -> String {
        // HMAC takes keys of any length, so this never fails; the fallback
        // keeps library code free of panics all the same.
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(self.bytes()) else {
            return String::new();
        };
        for part in parts {
            mac.update(part);
        }
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// Compares two credentials without stopping at the first difference, so the
/// answer time does not tell how much of a guess was right.
pub fn credentials_match(presented: &str, expected: &str) -> bool {
    let (a, b) = (presented.as_bytes(), expected.as_bytes());
    if a.len() != b.len() || expected.is_empty() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> ClusterKey {
        ClusterKey::from_hex(&"0f".repeat(32)).expect("key")
    }

    #[test]
    fn credentials_are_distinct_and_stable() {
        let k = key();
        let a = k.node_credential("a");
        assert_eq!(a, k.node_credential("a"));
        assert_eq!(a.len(), 64);
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        let all = [
            a.clone(),
            k.node_credential("b"),
            k.node_credential(""),
            k.client_credential(),
            k.admin_credential(),
        ];
        for (i, x) in all.iter().enumerate() {
            for y in &all[i + 1..] {
                assert_ne!(x, y);
            }
        }
        let other = ClusterKey::generate().expect("key");
        assert_ne!(other.node_credential("a"), a);
        assert_ne!(other.admin_credential(), k.admin_credential());
    }

    #[test]
    fn matches_the_documented_openssl_derivation() {
        // printf 'pgtp admin credential\0' |
        //   openssl dgst -sha256 -mac HMAC -macopt hexkey:0f0f...0f
        let expected = "0afd1d97b9a984e255f05245462a60deef477d1de8d6c08770e9a9011e897d7c";
        assert_eq!(key().admin_credential(), expected);
        // printf 'pgtp node credential\0%s' node-0 | openssl dgst ... (the same key)
        let node_0 = "f8f7f75ce027605cdbc7e40cae111d8371d6d404cf0aeb00766acb0da1f59e02";
        assert_eq!(key().node_credential("node-0"), node_0);
    }

    #[test]
    fn comparison() {
        assert!(credentials_match("abc", "abc"));
        assert!(!credentials_match("abd", "abc"));
        assert!(!credentials_match("ab", "abc"));
        assert!(!credentials_match("", ""));
    }
}
