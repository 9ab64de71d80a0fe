//! Handlers of the public routes, one module per part of the contract.

pub mod devices;
pub mod health;
pub mod host;
pub mod send;
