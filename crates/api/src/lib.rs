//! The public JSON API of orca-push, in one place: the request and reply of every route, the
//! contract's bounds on each field, and its error codes.
//!
//! The facade parses requests with these types, the registry and the queue check their gRPC input
//! with the same bounds, and the host SDK builds its requests with them, so a rule changes in one
//! place. Lengths are counted as JavaScript counts them (UTF-16 code units), as the contract means.

pub mod devices;
mod error;
mod host;
pub mod limits;
mod send;
mod values;

pub use devices::{Device, DeviceFilter, DeviceList, RegisterReply, RegisterRequest};
pub use error::{ErrorBody, ErrorCode};
pub use host::{ChallengeReply, ChallengeRequest, Health, Ready, SessionReply, SessionRequest};
pub use send::{Notification, SendReply, SendRequest, SendResult, SendStatus};
pub use values::{AgentState, ApnsEnvironment, Kind, Platform, Source, V1};

/// Why a request breaks the contract. The gateway answers every one of these `invalid_request`;
/// the text is for the caller's logs and never reaches the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Invalid(pub &'static str);

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Invalid {}

/// The `deliveryProtocol` of `GET /health` from which a gateway takes a notification's `kind`,
/// `expiresAt` and `sound`. Older gateways refuse unknown notification fields.
pub const DELIVERY_PROTOCOL_WITH_KIND: u32 = 2;
