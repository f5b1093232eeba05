//! Cluster membership: the shared key, the proofs of it that both ends
//! of every data-plane connection exchange before anything else, and the
//! coordinator credentials derived from it.

mod credentials;
mod key;
mod proof;

pub use credentials::{
    credentials_match, ADMIN_CREDENTIAL_LABEL, CLIENT_CREDENTIAL_LABEL, NODE_CREDENTIAL_LABEL,
};
pub use key::{key_from_flags, ClusterKey, KeyError, MIN_KEY_BYTES};
pub use proof::{nonce, Nonce, Proof, Role, Transcript, NONCE_LEN, PROOF_LEN};
