//! The load generator behind `pd-bench`: workloads (`scenario`), exact-length prompts
//! (`prompt`), one streaming request (`client`), the run (`runner`), statistics (`stats`),
//! reports and plots (`report`, `svg`) and comparisons between setups (`compare`).

pub mod client;
pub mod compare;
pub mod prompt;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod stats;
pub mod svg;
