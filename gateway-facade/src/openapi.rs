//! The OpenAPI 3.1 document of the public API. Its schemas are derived from the API crate's types
//! and its paths from the handlers' `#[utoipa::path]` attributes, which are also what the router
//! routes (`utoipa_axum::routes!`), so the document cannot name a route the router lacks or miss
//! one it has. `docs/openapi.json` is the committed copy; a test fails when they differ.

use utoipa::Modify;
use utoipa::OpenApi;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};

/// The name of the bearer scheme in `security` requirements.
pub const BEARER: &str = "bearer";

#[derive(OpenApi)]
#[openapi(
    info(
        title = "orca-push",
        description = "The push gateway between desktop Orca hosts and their paired phones. \
Every error answers `{\"error\": \"<code>\"}` with one of the contract's codes. Lengths are counted \
in UTF-16 code units, as JavaScript counts them; JSON Schema's maxLength counts code points, so a \
string within maxLength can still be too long. Every POST body is capped at 16 KiB.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    modifiers(&BearerScheme),
    tags(
        (name = "host", description = "Host authentication: challenge, proof, session"),
        (name = "devices", description = "Phone registrations"),
        (name = "send", description = "Notifications"),
        (name = "health", description = "Liveness and readiness"),
    ),
)]
pub struct ApiDoc;

struct BearerScheme;

impl Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            BEARER,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The sessionToken of POST /v1/host/session (43 characters of base64url).",
                    ))
                    .build(),
            ),
        );
    }
}

/// The document as `GET /openapi.json` serves it and docs/openapi.json holds it.
pub fn document() -> utoipa::openapi::OpenApi {
    crate::app::documented_routes().1
}

/// Pretty JSON with a final newline, as committed.
pub fn document_json() -> String {
    let mut text = document()
        .to_pretty_json()
        .unwrap_or_else(|_| "{}".to_owned());
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMITTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.json");

    /// Regenerate with `ORCA_PUSH_WRITE_OPENAPI=1 cargo test -p orca-push --lib openapi`.
    #[test]
    fn the_committed_document_is_the_routers() {
        let generated = document_json();
        if std::env::var_os("ORCA_PUSH_WRITE_OPENAPI").is_some() {
            std::fs::write(COMMITTED, &generated).unwrap();
        }
        let committed = std::fs::read_to_string(COMMITTED).unwrap_or_default();
        assert!(
            committed == generated,
            "docs/openapi.json differs from the router's document; regenerate it with \
             ORCA_PUSH_WRITE_OPENAPI=1 cargo test -p orca-push --lib openapi"
        );
    }

    #[test]
    fn every_operation_documents_its_errors_with_the_error_body() {
        let doc = serde_json::to_value(document()).unwrap();
        assert_eq!(doc["openapi"], "3.1.0");
        let paths = doc["paths"].as_object().unwrap();
        let mut operations = 0;
        for (path, item) in paths {
            for (method, op) in item.as_object().unwrap() {
                operations += 1;
                let responses = op["responses"].as_object().unwrap();
                for (status, response) in responses {
                    if status.starts_with('4') || status.starts_with('5') {
                        let schema = &response["content"]["application/json"]["schema"]["$ref"];
                        assert_eq!(
                            schema, "#/components/schemas/ErrorBody",
                            "{method} {path} {status}"
                        );
                    }
                }
                if path.starts_with("/v1/") {
                    for status in ["400", "413", "429", "503"] {
                        let optional = (method == "get" || method == "delete")
                            && (status == "413" || status == "400");
                        assert!(
                            optional || responses.contains_key(status),
                            "{method} {path} lacks {status}"
                        );
                    }
                }
                if path.starts_with("/v1/") && !path.starts_with("/v1/host/") {
                    assert!(responses.contains_key("401"), "{method} {path}");
                    assert_eq!(op["security"][0][BEARER], serde_json::json!([]));
                }
            }
        }
        assert_eq!(operations, 9, "every route of the router is documented");
    }
}
