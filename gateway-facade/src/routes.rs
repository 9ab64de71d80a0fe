//! Handlers of the public routes, one module per part of the contract.

pub mod health;
pub mod host;
