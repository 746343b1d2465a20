//! A fake act_runner in one-shot mode that follows the executor contract
