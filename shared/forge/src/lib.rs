//! The forge side of jetrunner: the runner protocol's protobuf types and a Connect unary client.

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
