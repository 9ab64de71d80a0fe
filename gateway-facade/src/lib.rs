//! The public face of orca-push: an axum HTTP API that validates the contract's JSON and translates
//! it into gRPC calls to the auth, registry, queue and sender services. It owns no tables.
//!
//! It must never log or put in a span a push token, title, body, session token, or more than the
//! first 4 characters of a host fingerprint, and never answer an error with internal detail.

pub mod app;
pub mod auth;
pub mod backends;
pub mod cli;
pub mod config;
pub mod connections;
pub mod enqueues;
pub mod error;
pub mod host_cli;
pub mod json;
pub mod limits;
pub mod metrics;
pub mod openapi;
pub mod resolves;
pub mod routes;
pub mod sessions;
pub mod settings;
pub mod topology;

pub use app::{AppState, router};
pub use config::{Config, ConfigError, Mode, ServiceName};
pub use error::ApiError;
