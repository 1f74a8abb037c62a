"""The drafter interface both services share (and plugins implement): see interface.py for the contract."""
from .device_schedule import DeviceSchedule, ScheduleChanges, apply_changes, changes_between
from .device_drafting import DeviceDrafts, DeviceDraftStep, DraftsOnDevice, DraftsOnDeviceLater
from .handshake import refusal_reason, vocabulary_fingerprint
from .interface import AnswersLater, DraftBatch, DraftInput, DraftOutput, Drafter, DrafterInfo, DrafterOptions, ModelFacts, \
    OutputGrammar, PrefixBlocks
from .plugins import ENTRY_POINT_GROUP, load_plugin, plugin_entry_points
from .proposals import device_drafts_problem, proposal_problem

__all__ = ["AnswersLater", "DeviceDraftStep", "DeviceSchedule", "ScheduleChanges", "apply_changes", "changes_between", "DeviceDrafts", "DraftsOnDevice", "DraftsOnDeviceLater", "DraftBatch", "DraftInput", "DraftOutput", "Drafter", "DrafterInfo", "DrafterOptions", "ModelFacts", "OutputGrammar", "PrefixBlocks",
           "ENTRY_POINT_GROUP", "load_plugin", "plugin_entry_points", "device_drafts_problem", "proposal_problem", "refusal_reason",
           "vocabulary_fingerprint"]
