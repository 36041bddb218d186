mod dbbench;
mod evolve;
mod harness;
mod queue;
mod rollout;
mod router;
mod storage;
mod training;
