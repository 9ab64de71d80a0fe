//! The contract's enumerations and the protocol version field.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        pub enum $name {
            $(#[serde(rename = $text)] $variant),+
        }

        impl $name {
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The contract's spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }

            pub fn parse(text: &str) -> Option<Self> {
                match text {
                    $($text => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

wire_enum!(
    /// What raised a notification.
    Source {
        AgentTaskComplete = "agent-task-complete",
        TerminalBell = "terminal-bell",
        Plugin = "plugin",
    }
);

wire_enum!(
    /// An agent's state as the gateway knows it. The host maps its richer states onto these.
    AgentState {
        NeedsInput = "needs-input",
        Finished = "finished",
    }
);

wire_enum!(
    /// A notification is an alert (the default) or the dismissal of an earlier alert.
    Kind {
        Alert = "alert",
        Dismiss = "dismiss",
    }
);

wire_enum!(
    Platform {
        Ios = "ios",
        Android = "android",
    }
);

wire_enum!(
    /// Which APNs endpoint an iOS token belongs to.
    ApnsEnvironment {
        Sandbox = "sandbox",
        Production = "production",
    }
);

/// The protocol version field `v`, which must be exactly 1.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct V1;

impl<'de> Deserialize<'de> for V1 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match u64::deserialize(deserializer)? {
            1 => Ok(V1),
            _ => Err(serde::de::Error::custom("v must be 1")),
        }
    }
}

#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for V1 {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::Integer)
            .enum_values(Some([1]))
            .description(Some("The protocol version: exactly 1."))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for V1 {}

impl Serialize for V1 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u8(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_speak_the_contract() {
        for source in Source::ALL {
            let json = serde_json::to_string(source).unwrap();
            assert_eq!(json, format!("\"{}\"", source.as_str()));
            assert_eq!(Source::parse(source.as_str()), Some(*source));
        }
        assert_eq!(
            serde_json::from_str::<AgentState>("\"needs-input\"").unwrap(),
            AgentState::NeedsInput
        );
        assert!(serde_json::from_str::<AgentState>("\"working\"").is_err());
        assert_eq!(Platform::parse("ios"), Some(Platform::Ios));
        assert_eq!(Kind::parse("delete"), None);
    }

    #[test]
    fn v_is_exactly_one() {
        assert_eq!(serde_json::to_string(&V1).unwrap(), "1");
        assert!(serde_json::from_str::<V1>("1").is_ok());
        assert!(serde_json::from_str::<V1>("2").is_err());
        assert!(serde_json::from_str::<V1>("\"1\"").is_err());
    }
}
