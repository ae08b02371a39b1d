//! `Budget`: keep the activations that save the most recompute per byte, up to a number of
//! bytes, and recompute the rest.

use super::{ActivationSite, CheckpointPolicy, Retention, SiteCost, Tags};
use crate::error::Result;
use serde::{Deserialize, Deserializer, Serialize};

/// Keeps the activations that save the most recomputation per byte until `bytes` are kept
/// (over every layer of one micro-batch), and recomputes the rest.
///
/// Each layer's input is always kept, as under [`super::Full`]: dropping one would rerun
/// every layer before it, so a budget never recomputes more than full recomputation.
/// Those inputs count against the budget; the other activations are then taken by
/// recompute FLOPs per byte ([`SiteCost::flops_per_byte`]), the largest first, each one
/// kept if it still fits. So `bytes = 0` (or any budget below the layer inputs) is
/// [`super::Full`], and a budget at least every activation's bytes is
/// [`super::NoRecompute`].
///
/// In a config: `[checkpoint] kind = "budget"`, `bytes = 2147483648` or `bytes = "2GiB"`;
/// on the command line `--recompute budget:2GiB`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// Activation bytes to keep for backward per micro-batch (an integer, or a size such
    /// as `"2GiB"` in a config).
    #[serde(deserialize_with = "bytes_or_size")]
    pub bytes: u64,
}

impl Budget {
    /// A budget of `bytes`.
    pub fn new(bytes: u64) -> Self {
        Budget { bytes }
    }

    /// A budget written as a size: `2GiB`, `512MB`, `1000` or `0`
    /// ([`crate::estimate::parse_bytes`]).
    pub fn parse(size: &str) -> Result<Self> {
        if size.trim().chars().all(|c| c == '0' || c == '.') && !size.trim().is_empty() {
            return Ok(Budget { bytes: 0 });
        }
        let bytes = crate::estimate::parse_bytes(size).map_err(|_| {
            crate::error::Error::config(
                "budget",
                format!(
                    "`{size}` is not a size of memory; write e.g. 2GiB, 512MB, 1073741824 or 0 \
                     (budget:2GiB on the command line, bytes = \"2GiB\" in a config)"
                ),
            )
        })?;
        Ok(Budget { bytes })
    }

    /// The retention of each of `sites` under this budget (see [`Budget`]).
    pub fn choose(&self, sites: &[SiteCost]) -> Vec<Retention> {
        let mut plan = vec![Retention::Recompute; sites.len()];
        let mut used = 0u64;
        for (i, s) in sites.iter().enumerate() {
            if s.site.is(Tags::LAYER_INPUT) {
                plan[i] = Retention::Keep;
                used = used.saturating_add(s.site.bytes);
            }
        }
        let mut rest: Vec<usize> = (0..sites.len())
            .filter(|&i| plan[i] == Retention::Recompute)
            .collect();
        // The most FLOPs saved per byte first; ties in forward order.
        rest.sort_by(|&a, &b| {
            sites[b]
                .flops_per_byte()
                .total_cmp(&sites[a].flops_per_byte())
                .then(a.cmp(&b))
        });
        for i in rest {
            let bytes = sites[i].site.bytes;
            if used.saturating_add(bytes) <= self.bytes {
                used += bytes;
                plan[i] = Retention::Keep;
            }
        }
        plan
    }
}

#[typetag::serde(name = "budget")]
impl CheckpointPolicy for Budget {
    /// Asked one site at a time (without the costs a plan sees), a budget keeps the layer
    /// inputs and recomputes the rest, as [`super::Full`].
    fn retain(&self, site: &ActivationSite) -> Retention {
        if site.is(Tags::LAYER_INPUT) {
            Retention::Keep
        } else {
            Retention::Recompute
        }
    }

    fn plan(&self, sites: &[SiteCost]) -> Option<Vec<Retention>> {
        Some(self.choose(sites))
    }
}

/// A byte count written as an integer or as a size string (`"2GiB"`).
fn bytes_or_size<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Size::deserialize(d)? {
        Size::Bytes(b) => Ok(b),
        Size::Text(t) => Budget::parse(&t)
            .map(|b| b.bytes)
            .map_err(serde::de::Error::custom),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(layer: usize, name: &'static str, tags: Tags, bytes: u64, flops: u64) -> SiteCost {
        SiteCost {
            site: ActivationSite {
                layer,
                n_layer: 2,
                name,
                tags,
                bytes,
            },
            recompute_flops: flops,
        }
    }

    fn sites() -> Vec<SiteCost> {
        let mut v = vec![];
        for l in 0..2 {
            v.push(site(l, "x", Tags::LAYER_INPUT, 100, 1000));
            v.push(site(l, "qkv", Tags::PROJECTION, 300, 9000)); // 30 per byte
            v.push(site(l, "probs", Tags::QUADRATIC, 400, 400)); // 1 per byte
            v.push(site(l, "ln", Tags::NORM_OUT, 100, 500)); // 5 per byte
        }
        v
    }

    #[test]
    fn keeps_layer_inputs_then_the_most_flops_per_byte() {
        use Retention::{Keep as K, Recompute as R};
        assert_eq!(Budget::new(0).choose(&sites()), [K, R, R, R, K, R, R, R]);
        assert_eq!(Budget::new(800).choose(&sites()), [K, K, R, R, K, K, R, R]);
        // 200 for the inputs, 600 for both qkv, 100 left: one norm output.
        assert_eq!(Budget::new(900).choose(&sites()), [K, K, R, K, K, K, R, R]);
        assert_eq!(Budget::new(u64::MAX).choose(&sites()), [K; 8]);
    }

    #[test]
    fn sizes_parse_and_deserialize() {
        assert_eq!(Budget::parse("0").unwrap().bytes, 0);
        assert_eq!(Budget::parse("2GiB").unwrap().bytes, 2 << 30);
        assert!(Budget::parse("lots").is_err());
        let b: Budget = serde_json::from_str(r#"{"bytes": "1KiB"}"#).unwrap();
        assert_eq!(b.bytes, 1024);
        let b: Budget = serde_json::from_str(r#"{"bytes": 77}"#).unwrap();
        assert_eq!(b.bytes, 77);
        assert!(serde_json::from_str::<Budget>(r#"{"bytes": "x"}"#).is_err());
    }
}
