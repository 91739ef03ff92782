//! A compat request's parameters, as read from its query string and body (see `form`).

use std::collections::HashMap;

/// A request's parameters: the query string, then the body (form, multipart or JSON).
pub(super) struct Params {
    pub(super) values: HashMap<String, String>,
    /// A `file` part of a multipart body.
    pub(super) file: Option<Vec<u8>>,
    pub(super) json: bool,
    pub(super) acao: bool,
}

impl Params {
    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str).filter(|v| !v.is_empty())
    }
}
