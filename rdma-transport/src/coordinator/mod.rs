//! Talking to the coordinator: the shared JSON types and the HTTP client.
pub mod api;
