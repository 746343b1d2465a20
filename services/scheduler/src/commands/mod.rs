//! The commands the reconciler sends the scheduler (`jr.command.scheduler.*`), one file a
//! command, and the one place that routes a delivery to its handler.

pub mod fail_task;
pub mod redispatch;

use std::sync::Arc;

use jr_bus::{Bus, Delivery, Disposition};
use jr_intake::ForgeCommands;
use jr_protocol::Kind;
use jr_seal::Sealer;

/// What the command handlers work with.
#[derive(Clone)]
pub struct Context {
    pub bus: Bus,
    /// Each forge's answers to the commands about its assignments.
    pub forges: Vec<Arc<dyn ForgeCommands>>,
    pub sealer: Arc<Sealer>,
}

/// Handles one command delivered on the scheduler's consumer.
pub async fn handle(ctx: &Context, delivery: Delivery) -> Disposition {
    match delivery.envelope.kind() {
        Kind::Redispatch => redispatch::handle(ctx, delivery).await,
        Kind::FailTask => fail_task::handle(ctx, delivery).await,
        other => Disposition::Term(format!(
            "{} is not a command the scheduler executes",
            other.as_str()
        )),
    }
}
