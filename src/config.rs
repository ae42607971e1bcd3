//! Tiers and the operations that use them, loaded from TOML, so retention is configured next to the
//! routes it protects:
//!
//! ```toml
//! default = "standard"            # the tier of operations not listed below
//!
//! [tiers.ledger]                  # overrides fields of a preset (ephemeral, standard, webhook, ledger)
//! lease = "60s"
//! lease_expiry = "mark_indeterminate"
//!
//! [tiers.partner]                 # a tier of your own, starting from the built-in `standard`
//! redis_ttl = "2h"
//! retention = "30d"               # or "never"
//! tombstone = "90d"               # how long a purged key answers "expired"; or "never"
//! new_keys = "1000/1m"            # quota: new keys one tenant may start per window
//! live_keys = 50                  # quota: keys one tenant may have in progress at once
//!
//! [operations]
//! "POST /payments" = "ledger"
//! "POST /webhooks/*" = "webhook"  # a trailing * matches any operation with that prefix
//! ```
//!
//! Durations are a number and a unit: `ms`, `s`, `m`, `h` or `d`. Every tier is validated like
//! [`PolicyBuilder::build`]: a lease shorter than the Redis TTL, a Redis TTL no longer than the retention.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use crate::error::ConfigError;
use crate::policy::{LeaseExpiry, Policy, PolicyBuilder, Tier};
use crate::quota::Quota;

/// Policies by operation, as read from a configuration file. Apply with [`crate::StoreBuilder::policies`].
#[derive(Clone, Debug)]
pub struct PolicyConfig {
    pub(crate) default: Policy,
    pub(crate) operations: Vec<(String, Policy)>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    default: Option<String>,
    #[serde(default)]
    tiers: BTreeMap<String, TierFields>,
    #[serde(default)]
    operations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TierFields {
    lease: Option<String>,
    redis_ttl: Option<String>,
    retention: Option<String>,
    tombstone: Option<String>,
    lease_expiry: Option<LeaseExpiry>,
    new_keys: Option<String>,
    live_keys: Option<u32>,
}

impl PolicyConfig {
    /// Parses and validates a configuration.
    ///
    /// # Errors
    /// [`ConfigError`] naming the tier, operation or field at fault.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let file: File = toml::from_str(text).map_err(ConfigError::PolicyFile)?;
        let mut tiers: BTreeMap<String, Policy> = [Tier::Ephemeral, Tier::Standard, Tier::Webhook, Tier::Ledger]
            .into_iter()
            .map(|tier| (tier.name().to_owned(), Policy::tier(tier)))
            .collect();
        for (name, fields) in file.tiers {
            let base = tiers.get(&name).cloned().unwrap_or_default();
            let quota = *base.quota();
            let policy = fields.apply(PolicyBuilder::from(base).name(name.clone()), quota);
            let policy = policy.and_then(PolicyBuilder::build);
            let policy = policy.map_err(|reason| ConfigError::Tier { tier: name.clone(), reason: Box::new(reason) })?;
            tiers.insert(name, policy);
        }
        let tier = |name: &str, used_by: &str| {
            let unknown = || ConfigError::UnknownTier { used_by: used_by.to_owned(), tier: name.to_owned() };
            tiers.get(name).cloned().ok_or_else(unknown)
        };
        let default = tier(file.default.as_deref().unwrap_or("standard"), "default")?;
        let operations = file
            .operations
            .iter()
            .map(|(operation, name)| Ok((operation.clone(), tier(name, &format!("operation {operation:?}"))?)))
            .collect::<Result<_, ConfigError>>()?;
        Ok(Self { default, operations })
    }
}

impl TierFields {
    /// The fields set on `builder`; `quota` is the base tier's, which the quota fields amend.
    fn apply(self, mut builder: PolicyBuilder, mut quota: Quota) -> Result<PolicyBuilder, ConfigError> {
        if let Some(lease) = self.lease {
            builder = builder.lease(parse_duration(&lease)?);
        }
        if let Some(ttl) = self.redis_ttl {
            builder = builder.redis_ttl(parse_duration(&ttl)?);
        }
        if let Some(retention) = self.retention {
            builder = builder.retention(if retention == "never" { None } else { Some(parse_duration(&retention)?) });
        }
        if let Some(horizon) = self.tombstone {
            builder = builder.tombstone(if horizon == "never" { None } else { Some(parse_duration(&horizon)?) });
        }
        if let Some(rule) = self.lease_expiry {
            builder = builder.lease_expiry(rule);
        }
        if let Some(new_keys) = self.new_keys {
            quota = with_new_keys(quota, &new_keys)?;
        }
        if let Some(limit) = self.live_keys {
            quota = quota.live_keys(limit);
        }
        Ok(builder.quota(quota))
    }
}

/// `quota` with the policy file's `new_keys` value: a count, a slash, a duration (`1000/1m`).
fn with_new_keys(quota: Quota, text: &str) -> Result<Quota, ConfigError> {
    let invalid = || ConfigError::Quota { reason: "new_keys is a count and a window, like \"1000/1m\"" };
    let (limit, window) = text.split_once('/').ok_or_else(invalid)?;
    let limit = limit.trim().parse().map_err(|_| invalid())?;
    Ok(quota.new_keys(limit, parse_duration(window.trim())?))
}

/// Parses `500ms`, `30s`, `15m`, `24h` or `7d`.
///
/// # Errors
/// [`ConfigError::InvalidDuration`] for anything else.
pub fn parse_duration(text: &str) -> Result<Duration, ConfigError> {
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let invalid = || ConfigError::InvalidDuration { text: text.to_owned() };
    let n: u64 = number.parse().map_err(|_| invalid())?;
    let unit = match unit {
        "ms" => Duration::from_millis(1),
        "s" => Duration::from_secs(1),
        "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        "d" => Duration::from_secs(86_400),
        _ => return Err(invalid()),
    };
    u32::try_from(n).ok().and_then(|n| unit.checked_mul(n)).ok_or_else(invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_count_per_window() {
        let parsed = with_new_keys(Quota::default(), "1000 / 1m").expect("valid");
        assert_eq!(parsed.new_key_limit(), Some((1000, Duration::from_secs(60))));
        for text in ["1000", "1000/", "/1m", "many/1m", "-1/1m", "10/soon"] {
            assert!(with_new_keys(Quota::default(), text).is_err(), "{text}");
        }
    }

    #[test]
    fn reads_tiers_and_operations() {
        let config = PolicyConfig::from_toml(
            r#"
            default = "ephemeral"
            [tiers.ledger]
            lease = "60s"
            lease_expiry = "mark_indeterminate"
            [tiers.partner]
            redis_ttl = "2h"
            retention = "30d"
            new_keys = "1000/1m"
            live_keys = 50
            [operations]
            "POST /payments" = "ledger"
            "POST /partners" = "partner"
            "POST /webhooks/*" = "webhook"
            "#,
        )
        .expect("valid");
        assert_eq!(config.default, Policy::tier(Tier::Ephemeral));
        let find = |op: &str| config.operations.iter().find(|(o, _)| o == op).map(|(_, p)| p.clone()).expect(op);
        let ledger = find("POST /payments");
        assert_eq!((ledger.name(), ledger.lease(), ledger.retention()), ("ledger", Duration::from_secs(60), None));
        assert_eq!(ledger.lease_expiry(), LeaseExpiry::MarkIndeterminate);
        let partner = find("POST /partners");
        assert_eq!((partner.name(), partner.retention()), ("partner", Some(Duration::from_secs(30 * 86_400))));
        assert_eq!(*partner.quota(), Quota::default().new_keys(1000, Duration::from_secs(60)).live_keys(50));
        assert_eq!(*ledger.quota(), Quota::default());
        assert_eq!(find("POST /webhooks/*").name(), "webhook");
    }

    #[test]
    fn refuses_inconsistent_or_unknown_settings() {
        for (text, fault) in [
            ("[tiers.short]\nretention = \"10m\"", "tier \"short\""),
            ("[tiers.slow]\nlease = \"2h\"", "tier \"slow\""),
            ("[operations]\n\"POST /x\" = \"gold\"", "unknown tier \"gold\""),
            ("default = \"gold\"", "unknown tier"),
            ("[tiers.x]\nlease = \"soon\"", "not a duration"),
            ("[tiers.x]\nlease_expiry = \"retry\"", "take_over"),
            ("[tiers.x]\nttl = \"1h\"", "unknown field"),
            ("[tiers.x]\nlive_keys = 0", "at least 1"),
            ("[tiers.x]\nnew_keys = \"100\"", "like \"1000/1m\""),
        ] {
            let error = PolicyConfig::from_toml(text).expect_err(text).to_string();
            assert!(error.contains(fault), "{text}: {error}");
        }
        assert_eq!(parse_duration("1500ms").ok(), Some(Duration::from_millis(1500)));
        assert!(parse_duration("99999999999d").is_err());
    }
}
