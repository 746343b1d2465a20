//! The forge side of jetrunner: the runner protocol's protobuf types and a Connect unary client.
//!
//! - [`proto`]: prost types of `runner.v1` and `ping.v1`.
//! - [`ForgeClient`]: Connect unary client (HTTP/1.1, `application/proto`, gzip replies).
//! - [`ForgeError`] / [`Code`]: errors, with Gitea's `unknown` + `rpc error: code = X` unwrapped.
//! - [`report`]: calls on jetrunner's own account (a final failure, a heartbeat).
//! - [`wire`]: paths, headers and request/response codec helpers for servers (facade, fake forge).

mod client;
mod code;
mod error;
pub mod report;
pub mod wire;

pub use client::{Credentials, ForgeClient};
pub use code::{
    Code, ConnectStatus, connect_error_body, gitea_legacy_message, parse_connect_error,
};
pub use error::ForgeError;

/// Generated protobuf types (`runner.v1`, `ping.v1`).
pub mod proto {
    pub mod runner {
        pub mod v1 {
            include!(concat!(env!("OUT_DIR"), "/runner.v1.rs"));
        }
    }
    pub mod ping {
        pub mod v1 {
            include!(concat!(env!("OUT_DIR"), "/ping.v1.rs"));
        }
    }
}
