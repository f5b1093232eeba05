//! Proofs of the cluster key in the handshake: an HMAC-SHA256 over both
//! nonces, both ids, the server's epoch and the protocol version, with the
//! prover's role first so a proof can never be reflected back.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::ClusterKey;

/// Bytes of a nonce and of a proof.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof.
pub const PROOF_LEN: usize = 32;

/// A fresh random nonce.
pub type Nonce = [u8; NONCE_LEN];
/// One side's proof that it holds the key.
pub type Proof = [u8; PROOF_LEN];

/// Who proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The page-server, in its CHALLENGE.
    Server,
    /// The client, in its AUTH.
    Client,
}

/// What both proofs of one handshake cover.
#[derive(Debug, Clone, Copy)]
pub struct Transcript<'a> {
    /// Wire protocol version.
    pub version: u8,
    /// The client's random id.
    pub client_id: u64,
    /// The node the client means to reach (the map's id for that address).
    pub node_id: &'a str,
    /// The client's nonce (HELLO).
    pub client_nonce: &'a Nonce,
    /// The server's nonce (CHALLENGE).
    pub server_nonce: &'a Nonce,
    /// The server's epoch (CHALLENGE).
    pub epoch: u64,
}

impl Transcript<'_> {
    /// The proof `role` sends for this transcript.
    pub fn prove(&self, key: &ClusterKey, role: Role) -> Proof {
        self.mac(key, role).finalize().into_bytes().into()
    }

    /// Whether `proof` is `role`'s proof for this transcript (constant time).
    pub fn verify(&self, key: &ClusterKey, role: Role, proof: &Proof) -> bool {
        self.mac(key, role).verify_slice(proof).is_ok()
    }

    fn mac(&self, key: &ClusterKey, role: Role) -> Hmac<Sha256> {
        // HMAC takes keys of any length: this cannot fail.
        let mut mac = match Hmac::<Sha256>::new_from_slice(key.bytes()) {
            Ok(mac) => mac,
            Err(_) => unreachable_key_length(),
        };
        mac.update(match role {
            Role::Server => b"pgtp handshake: server\0",
            Role::Client => b"pgtp handshake: client\0",
        });
        mac.update(&[self.version]);
        mac.update(&self.client_id.to_le_bytes());
        mac.update(&(self.node_id.len() as u64).to_le_bytes());
        mac.update(self.node_id.as_bytes());
        mac.update(self.client_nonce);
        mac.update(self.server_nonce);
        mac.update(&self.epoch.to_le_bytes());
        mac
    }
}

#[cold]
fn unreachable_key_length() -> ! {
    // `Hmac::new_from_slice` refuses no length (HMAC hashes long keys).
    std::process::abort()
}

/// A fresh random nonce from the OS.
///
/// # Errors
/// The OS gave no random bytes.
pub fn nonce() -> std::io::Result<Nonce> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_every_field_and_the_role() {
        let key = ClusterKey::generate().expect("key");
        let (cn, sn) = ([1u8; 32], [2u8; 32]);
        let t = Transcript {
            version: 3,
            client_id: 7,
            node_id: "a",
            client_nonce: &cn,
            server_nonce: &sn,
            epoch: 9,
        };
        let p = t.prove(&key, Role::Server);
        assert!(t.verify(&key, Role::Server, &p));
        assert!(!t.verify(&key, Role::Client, &p), "reflected");
        let other_key = ClusterKey::generate().expect("key");
        assert!(!t.verify(&other_key, Role::Server, &p));
        let (cn2, sn2) = ([3u8; 32], [4u8; 32]);
        for changed in [
            Transcript { version: 2, ..t },
            Transcript { client_id: 8, ..t },
            Transcript { node_id: "b", ..t },
            Transcript {
                client_nonce: &cn2,
                ..t
            },
            Transcript {
                server_nonce: &sn2,
                ..t
            },
            Transcript { epoch: 10, ..t },
        ] {
            assert!(!changed.verify(&key, Role::Server, &p), "{changed:?}");
        }
    }
}
