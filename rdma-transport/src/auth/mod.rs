//! Cluster membership: the shared key and the proofs of it that both ends
//! of every data-plane connection exchange before anything else.

mod key;
mod proof;

pub use key::{key_from_flags, ClusterKey, KeyError, MIN_KEY_BYTES};
pub use proof::{nonce, Nonce, Proof, Role, Transcript, NONCE_LEN, PROOF_LEN};
