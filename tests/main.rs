//! The integration suite: one test binary, one module per subject. Every test talks to real Redis and
//! Postgres servers it starts (or to `IDEMSTORE_TEST_DATABASE_URL` / `IDEMSTORE_TEST_REDIS_URL`).
//!
//! One binary, not one per file: each binary linked the whole dependency tree and compiled its own copy
//! of the generic code it used, which made most of a fresh build of the tests. A subject's tests are
//! `<module>::...` (`cargo nextest run -E 'test(/^faults::/)'`).

#[macro_use]
mod support;

mod attach;
mod batch;
mod client;
mod cluster;
mod demo;
mod derived;
mod edges;
mod encryption;
mod faults;
mod formats;
mod group_commit;
mod grpc;
mod http;
mod inbox;
mod layer;
mod logs;
mod model;
mod ops;
mod outbox;
mod partitions;
mod prometheus;
mod quotas;
mod records;
mod relay;
mod same_request;
mod store;
mod tool_server;
mod wait;
mod webhook_signatures;
