//! The coordinator: an HTTP service that stores node endpoints and the
//! guest-physical address (GPA) ownership map in SQLite.
//!
//! The JSON shapes are [`rdma_transport::coordinator::api`]; the routes are
//! listed by [`route_table`] and described in `docs/coordinator-openapi.yaml`;
//! `docs/coordinator.md` explains the design.
//!
//! Start it in-process from synchronous code with [`spawn`], or from async
//! code with [`serve`] / [`Server`].
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]
#![deny(clippy::print_stdout, clippy::print_stderr)]

mod auth;
mod backend;
mod body;
mod clock;
mod config;
mod connections;
mod error;
mod extract;
mod metrics;
mod routes;
mod server;
mod spawn;
mod state;
mod store;
mod validate;

pub use auth::Access;
pub use config::{CoordinatorConfig, EtcdConfig, Limits, StoreConfig};
pub use error::ServeError;
pub use routes::{route_table, HttpMethod, Route};
pub use server::{serve, Server};
pub use spawn::{spawn, RunningCoordinator};
pub use store::{ReplicaRefusal, StoreError};
