//! The sender's DNS resolver: the SSRF guard at connect time, which drops every address the
//! owner-URL policy refuses, so a name rebound to a private address after its check is refused.

use std::error::Error as StdError;
use std::net::{IpAddr, SocketAddr};

use super::url_policy::{UrlPolicy, addr_allowed};

/// Every address a name resolved to was refused by [`addr_allowed`]: the delivery is refused,
/// not retried.
#[derive(Debug)]
pub(super) struct AllAddressesRefused {
    refused: Vec<IpAddr>,
}

impl std::fmt::Display for AllAddressesRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown: Vec<String> = self.refused.iter().take(3).map(IpAddr::to_string).collect();
        let more = if self.refused.len() > 3 { format!(" and {} more", self.refused.len() - 3) } else { String::new() };
        write!(f, "the host resolves only to refused addresses ({}{more})", shown.join(", "))
    }
}

impl StdError for AllAddressesRefused {}

/// A name that could not be resolved (or resolved to nothing): worth retrying.
#[derive(Debug)]
pub(super) struct DnsFailed(String);

impl std::fmt::Display for DnsFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DNS lookup failed: {}", self.0)
    }
}

impl StdError for DnsFailed {}

/// Boxes an error as itself (`Box::new(e).into()` would box the box, and the error chain could
/// no longer be searched for it by type).
fn boxed(e: impl StdError + Send + Sync + 'static) -> Box<dyn StdError + Send + Sync> {
    Box::new(e)
}

/// Where names are looked up: the system's resolver through tokio, or (in tests) a fixed table.
#[derive(Clone)]
pub(super) enum Lookup {
    System,
    #[cfg(test)]
    Table(std::sync::Arc<std::collections::HashMap<String, Vec<IpAddr>>>),
}

/// The sender's DNS resolver: resolves, then keeps only the addresses [`addr_allowed`] accepts.
/// Runs at connect time, so the addresses connected to are the ones checked.
pub(super) struct GuardedResolver {
    pub(super) policy: UrlPolicy,
    pub(super) lookup: Lookup,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let (policy, lookup, host) = (self.policy, self.lookup.clone(), name.as_str().to_owned());
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = match lookup {
                Lookup::System => tokio::net::lookup_host((host.as_str(), 0))
                    .await
                    .map_err(|e| boxed(DnsFailed(e.kind().to_string())))?
                    .collect(),
                #[cfg(test)]
                Lookup::Table(table) => table
                    .get(&host)
                    .ok_or_else(|| boxed(DnsFailed("not in the test table".into())))?
                    .iter()
                    .map(|ip| SocketAddr::new(*ip, 0))
                    .collect(),
            };
            if addrs.is_empty() {
                return Err(boxed(DnsFailed("no addresses".into())));
            }
            let (allowed, refused): (Vec<SocketAddr>, Vec<SocketAddr>) =
                addrs.into_iter().partition(|a| addr_allowed(a.ip(), policy));
            if allowed.is_empty() {
                let refused = refused.iter().map(SocketAddr::ip).collect();
                return Err(boxed(AllAddressesRefused { refused }));
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}
