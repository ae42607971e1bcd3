//! The retry budget per host (gRPC's retry throttling): retries stop while most recent requests to a host
//! fail, so a client never multiplies the load on a server that is already down.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::policy::BudgetConfig;

/// Hosts remembered before the full buckets are forgotten.
const MAX_HOSTS: usize = 1024;

/// One token bucket per host, all starting full.
#[derive(Debug)]
pub(crate) struct RetryBudget {
    config: BudgetConfig,
    hosts: Mutex<HashMap<String, f64>>,
}

impl RetryBudget {
    pub(crate) fn new(config: BudgetConfig) -> Self {
        Self { config, hosts: Mutex::new(HashMap::new()) }
    }

    /// A final answer from `host` (a success or a refusal: the server works) earns `ratio` of a token.
    pub(crate) fn answered(&self, host: &str) {
        self.update(host, |tokens, config| (tokens + config.ratio).min(config.tokens));
    }

    /// An attempt at `host` failed in a way worth retrying: spends a token. Whether a retry may follow:
    /// more than half the bucket is left.
    pub(crate) fn failed(&self, host: &str) -> bool {
        let left = self.update(host, |tokens, _| (tokens - 1.0).max(0.0));
        left > self.config.tokens / 2.0
    }

    fn update(&self, host: &str, change: impl FnOnce(f64, BudgetConfig) -> f64) -> f64 {
        // A poisoned lock only means another request panicked mid-update; the counts are still numbers.
        let mut hosts = self.hosts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A full bucket says nothing a new one would not: forgotten once many hosts were seen.
        if hosts.len() >= MAX_HOSTS {
            hosts.retain(|_, tokens| *tokens < self.config.tokens);
        }
        let tokens = hosts.entry(host.to_owned()).or_insert(self.config.tokens);
        *tokens = change(*tokens, self.config);
        *tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_stop_retries_until_successes_earn_them_back() {
        let budget = RetryBudget::new(BudgetConfig { tokens: 10.0, ratio: 0.5 });
        // 10 tokens: retries are allowed while more than 5 are left after the failure.
        let allowed: Vec<bool> = (0..6).map(|_| budget.failed("api.example")).collect();
        assert_eq!(allowed, [true, true, true, true, false, false]);
        assert!(budget.failed("other.example"), "hosts have budgets of their own");
        for _ in 0..4 {
            budget.answered("api.example");
        }
        // 4 + 2 = 6 tokens; a failure leaves 5, not more than half.
        assert!(!budget.failed("api.example"));
        for _ in 0..6 {
            budget.answered("api.example");
        }
        assert!(budget.failed("api.example"));
    }

    #[test]
    fn full_buckets_are_forgotten_once_many_hosts_were_seen() {
        let budget = RetryBudget::new(BudgetConfig { tokens: 10.0, ratio: 0.5 });
        budget.failed("failing.example");
        for n in 0..5_000 {
            budget.answered(&format!("host-{n}.example"));
        }
        let hosts = budget.hosts.lock().expect("hosts");
        assert!(hosts.len() <= MAX_HOSTS);
        assert!(hosts.contains_key("failing.example"), "a bucket below full is kept");
    }
}
