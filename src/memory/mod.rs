//! Memory accounting: categories, the ledger, the event stream and its observers (among
//! them the timeline, which plots and exports it, and the op profile).

mod category;
mod event;
mod ledger;
mod observer;
mod op_profile;
mod timeline;

pub use category::{format_bytes, CategoryBytes, MemoryCategory};
pub use event::{DeviceMemory, MemoryEvent, Phase};
pub use ledger::{LabelBytes, Ledger, LedgerSnapshot, OpFence, OpSpan};
pub use observer::{LogObserver, MemoryObserver, Observers, PeakTracker};
pub use op_profile::{OpProfile, OpTotals, SharedOpProfile};
pub use timeline::{StepPeak, Timeline, TimelineAxis, TIMELINE_FILES};
