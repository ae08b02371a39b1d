//! Memory accounting: categories, the ledger, the event stream and its observers.

mod category;
mod event;
mod ledger;
mod observer;

pub use category::{format_bytes, CategoryBytes, MemoryCategory};
pub use event::{DeviceMemory, MemoryEvent, Phase};
pub use ledger::{LabelBytes, Ledger, LedgerSnapshot, OpSpan};
pub use observer::{LogObserver, MemoryObserver, Observers, PeakTracker};
