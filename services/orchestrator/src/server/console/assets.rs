//! The console's page, script and style, compiled into the binary (nothing fetched at run time),
//! and the headers every answer carries: a Content-Security-Policy that allows scripts and styles
//! from the console only (no inline script), no framing, no referrer, no caching of answers.

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// The one page; the script draws every view in it.
const PAGE: &str = include_str!("../../../console/index.html");
/// The files the page loads, by name: content and type.
const ASSETS: [(&str, &str, &str); 2] = [
    (
        "app.js",
        include_str!("../../../console/app.js"),
        "text/javascript; charset=utf-8",
    ),
    (
        "app.css",
        include_str!("../../../console/app.css"),
        "text/css; charset=utf-8",
    ),
];

/// What a page may load and do.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// `GET /`: the page.
pub(super) async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE).into_response()
}

/// `GET /assets/{name}`.
pub(super) async fn asset(Path(name): Path<String>) -> Response {
    match ASSETS.iter().find(|(n, ..)| *n == name) {
        Some((_, body, kind)) => ([(header::CONTENT_TYPE, *kind)], *body).into_response(),
        None => (StatusCode::NOT_FOUND, "no such file").into_response(),
    }
}

/// Adds the security headers to `answer`.
pub(super) async fn with_security_headers(mut answer: Response) -> Response {
    let headers = answer.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    answer
}

/// Adds HSTS to `answer` when the console is reached over HTTPS (`secure`).
pub(super) async fn with_hsts(mut answer: Response, secure: bool) -> Response {
    if secure {
        answer.headers_mut().insert(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static("max-age=31536000"),
        );
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_has_no_inline_script_or_style_and_loads_only_the_consoles_files() {
        assert!(PAGE.contains(r#"<script type="module" src="/assets/app.js"></script>"#));
        let inline_script = PAGE
            .match_indices("<script")
            .any(|(at, _)| !PAGE[at..].starts_with("<script type=\"module\" src="));
        assert!(!inline_script, "no inline script");
        assert!(!PAGE.contains("<style") && !PAGE.contains(" style="), "no inline style");
        let handler = PAGE.match_indices(" on").any(|(at, _)| {
            let name: String = PAGE[at + 1..].chars().take_while(char::is_ascii_alphabetic).collect();
            PAGE[at + 1 + name.len()..].starts_with('=')
        });
        assert!(!handler, "no inline event handler");
        for (name, body, _) in ASSETS {
            assert!(!body.is_empty(), "{name}");
            assert!(
                !body.contains("http://") && !body.contains("https://"),
                "{name} loads nothing from elsewhere"
            );
        }
    }
}
