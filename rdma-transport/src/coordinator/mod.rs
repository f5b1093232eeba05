//! Talking to the coordinator: the shared JSON types and the HTTP client.
pub mod api;
mod client;
mod error;

pub use client::CoordinatorClient;
pub use error::CoordinatorError;
