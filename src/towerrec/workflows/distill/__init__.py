"""External distillation of a student from a foundation model's logits (ExFM;
docs/exfm.md): the loss and the adapter's own pass (``loss.py``), teacher logits in
process (``teacher.py``) and the augmentation service that writes them beside the
students' data (``augment.py``, ``towerrec distill serve``). The heads themselves are
model-side modules (``towerrec.models.distill_heads``), built with the model."""
