//! The load generator behind `pd-bench`: workloads (`scenario`), exact-length prompts
//! (`prompt`), one streaming request (`client`), the run (`runner`), statistics (`stats`),
//! reports and plots (`report`, `svg`), comparisons between setups (`compare`), and
//! hostile clients (idle connections, slow readers, a health probe) beside a run (`hostile`).

pub mod client;
pub mod compare;
pub mod hostile;
pub mod prompt;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod stats;
pub mod svg;
