//! Talking to the coordinator: the shared JSON types, the credentials and
//! the HTTP client.
pub mod api;
mod client;
mod credential;
mod error;

pub use client::CoordinatorClient;
pub use credential::{Credential, NODE_BEARER_PREFIX};
pub use error::CoordinatorError;
